"""Sub-axis groups are the mesh's (Note [sub-axis groups]): made on the Topology, once per
name, and printed by `print(engine.mesh)` with the axes."""

from meshspeed.testing import run_distributed


def _subgroups():
    import torch.distributed as dist

    from meshspeed.topology import ParallelDims, build_topology

    mesh = build_topology(ParallelDims(4, tp=2))
    pairs = [[0, 2], [1, 3]]
    first = mesh.subgroup("pairs", pairs)
    again = mesh.subgroup("pairs", pairs)
    alias = mesh.subgroup("same layout", pairs)  # reuses the groups, made once
    partial = mesh.subgroup("ranks 0 and 1", [[0, 1]])  # ranks 2, 3 are in none
    try:
        mesh.subgroup("pairs", [[0, 1], [2, 3]])
        clash = None
    except ValueError as err:
        clash = str(err)
    return {"ranks": dist.get_process_group_ranks(first), "same": first is again is alias,
            "partial": partial is None, "text": str(mesh), "clash": clash}


def test_subgroups_are_made_once_and_printed_with_the_mesh():
    out = run_distributed(_subgroups, world_size=4)
    assert [o["ranks"] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(o["same"] for o in out)
    assert [o["partial"] for o in out] == [False, False, True, True]
    assert all("another layout" in o["clash"] for o in out)
    text = out[1]["text"]
    assert text.splitlines()[0].startswith("Topology(rank 1 of 4 ranks")
    assert "  tp     [0, 1]" in text and "  dp     [1, 3]" in text
    assert "  pairs  [1, 3]" in text and "ranks 0 and 1" in text
    assert "(not in one)" in out[3]["text"]
