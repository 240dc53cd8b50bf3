"""Per-rank entry point under `meshspeed run`; torchrun starts

    python -m meshspeed.launcher.rank_entry [-m] TARGET [ARGS...]

on each rank. TARGET runs as ``python TARGET ARGS`` (or ``python -m TARGET ARGS``) would
run it: as __main__, with sys.argv and sys.path[0] set the same way. When it ends with an
uncaught exception, its one-line cause and traceback go to a record in the folder
`meshspeed run` named (failures.py) instead of to stderr (to both when torchrun will
restart the job), and the rank exits with status 1, as Python would: `meshspeed run` then
prints the first failing rank's traceback and cause once, at the end (Note [the first
failure is the cause]). Without that folder (run by hand) the exception is Python's own.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

from meshspeed.launcher.failures import ERRORS_DIR_ENV, one_line, write_record


def _script_frames(tb):
    """`tb` without its first frames, which are this module's and runpy's."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>",
            os.path.join(os.path.dirname(here), "compat", "child.py")}  # --deepspeed-compat's entry
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


def _is_usage_error(exc: BaseException) -> bool:
    """meshspeed's one-sentence errors about the user's config or arguments (ConfigError and
    its kind): the frames inside meshspeed say nothing the sentence does not."""
    return any(c.__name__ == "ConfigError" and c.__module__.startswith("meshspeed.") for c in type(exc).__mro__)


def _traceback_text(exc: BaseException) -> str:
    """The traceback without the cause line(s) at its end; for a usage error, only down to
    the last frame outside meshspeed (the user's call)."""
    tb = _script_frames(exc.__traceback__)
    if _is_usage_error(exc):
        frames = traceback.extract_tb(tb)
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
        user = [i for i, f in enumerate(frames) if not f.filename.startswith(package)]
        if user:
            hidden = len(frames) - user[-1] - 1
            return ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames[: user[-1] + 1]))
                    + (f"  ... {hidden} frame{'s' * (hidden > 1)} in meshspeed\n" if hidden else ""))
    full = traceback.format_exception(type(exc), exc, tb)
    return "".join(full[: len(full) - len(traceback.format_exception_only(type(exc), exc))])


def cause_of(exc: BaseException) -> str:
    """`ValueError: tensor_parallel.autotp_size 3 ...`, on one line (the class without its module)."""
    message = str(exc)
    return one_line(f"{type(exc).__name__}: {message}" if message else type(exc).__name__)


def _record(folder: str, exc: BaseException) -> None:
    write_record(folder, os.environ, cause_of(exc), _traceback_text(exc))


def _restarts_left(environ) -> bool:
    """Whether torchrun restarts the job after this failure (--max-restarts not spent): the
    report at the end covers the last attempt only."""
    done, most = environ.get("TORCHELASTIC_RESTART_COUNT", "0"), environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return done.isdigit() and most.isdigit() and int(done) < int(most)


def run_target(argv: list[str]) -> None:
    module = argv[:1] == ["-m"]
    target, args = (argv[1], argv[2:]) if module else (argv[0], argv[1:])
    sys.argv = [target, *args]
    if module:  # `python -m` keeps the working directory as sys.path[0], as we were started
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:  # `python script.py` puts the script's directory first instead of the working one
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == ["-m"]:
        raise SystemExit("usage: python -m meshspeed.launcher.rank_entry [-m] TARGET [ARGS...]")
    folder = os.environ.get(ERRORS_DIR_ENV)
    try:
        run_target(argv)
    except KeyboardInterrupt:
        raise
    except SystemExit as stop:  # sys.exit("message") is a failure with a cause; a status is not
        if folder and isinstance(stop.code, str):
            write_record(folder, os.environ, one_line(stop.code), "")
            if _restarts_left(os.environ):
                print(stop.code, file=sys.stderr)
            sys.exit(1)
        raise
    except BaseException as exc:  # every uncaught exception is the rank's failure
        if not folder:
            raise
        if _restarts_left(os.environ):  # torchrun starts the job again: say it now, as Python would
            traceback.print_exc()
        try:
            _record(folder, exc)
        except OSError:  # the folder is gone (the launcher stopped): Python's own report
            raise exc from None
        sys.stdout.flush()
        sys.exit(1)


if __name__ == "__main__":
    main()
