"""`python -m ckpt_ext.bench [options]`: runs the benchmark suite, benchmarks/suite.py, of the source
checkout this package was imported from (an editable install or the repository root).

The suite itself is not part of the package: it lives in the repository (benchmarks/), with its own
dependencies (`pip install '.[bench]'`). This entry point is kept because earlier instructions and
scripts call it; from an installed wheel it says where the suite is instead.
"""
import os
import runpy
import sys


def main(argv=None) -> None:
    suite = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "suite.py")
    if not os.path.isfile(suite):
        sys.exit("ckpt_ext.bench: the benchmark suite is not shipped with the package. Run it from a source "
                 "checkout:\n    git clone <ckpt_ext repository> && cd ckpt_ext && pip install '.[bench]'\n"
                 "    python benchmarks/suite.py --help")
    print(f"ckpt_ext.bench: running {suite}", file=sys.stderr)
    sys.argv = [suite] + list(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, os.path.dirname(suite))  # the suite imports its sibling modules (common, variants)
    runpy.run_path(suite, run_name="__main__")


if __name__ == "__main__":
    main()
