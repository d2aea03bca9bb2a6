"""python -m models.native [--all | --levels L1,L2]: build the C++ libraries ahead of first use."""
import sys

from models.native.toolchain import build_all, levels_from_argv

for built in build_all(levels_from_argv(sys.argv[1:])):
    print(built)
