"""`python -m appliance` and the `omlx` command."""

import sys


def main() -> int:
    """Returns the exit status of one `omlx` invocation.

    `omlx serve` re-executes itself once, with OpenBLAS preloaded and malloc tuned, before
    the CLI's imports (pydantic, numpy: 1-2 s) that a later re-exec would pay twice.
    """
    if sys.argv[1:2] == ["serve"]:
        from appliance.platform import ensure_process_env

        ensure_process_env()
    from appliance.cli import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
