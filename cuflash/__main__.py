"""Command line: python -m cuflash {check, info, bench, autotune}."""

import sys

USAGE = """usage: python -m cuflash COMMAND [options]

commands:
  check     compile every shipped kernel with NVRTC (no GPU needed); report registers and spills
  info      device, versions, cache locations, tuned configurations; which config a call would use
  bench     forward benchmark (--backward: forward+backward) against naive CuPy and torch SDPA (needs a GPU)
  autotune  find and cache the fastest kernel configurations for this GPU (needs a GPU)
"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "check":
        from .cli.check import main as run
    elif command == "info":
        from .cli.info import main as run
    elif command == "bench":
        from .bench.cli import main as run
    elif command == "autotune":
        from .cli.autotune import main as run
    else:
        print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
