"""Command-line tools over the library: `meshspeed pipeline-plot` (pipeline_plot.py)."""
