"""The benchmark scripts as modules for the tests. benchmarks/ is a folder of scripts with sibling modules
(``import common``), not a package, so importing this module puts the folder on sys.path, once; import it
before the benchmark modules."""
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
