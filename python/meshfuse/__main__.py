"""The `meshfuse` command of a pip install: runs the C++ CLI installed inside the package
(meshfuse/bin/meshfuse), so `meshfuse info` and `python -m meshfuse info` are the same program."""

import importlib.util
import os
import sys


def cli_path():
    # Next to the extension, not to this file: an editable install keeps the .py files in the
    # source tree and the built files in site-packages.
    extension = importlib.util.find_spec("meshfuse._meshfuse").origin
    return os.path.join(os.path.dirname(extension), "bin", "meshfuse")


def main():
    path = cli_path()
    if not os.path.exists(path):
        sys.exit(f"meshfuse: the CLI is not in this package ({path}); a build tree has it at "
                 "<build>/apps/meshfuse/meshfuse, a pip install puts it here")
    os.execv(path, ["meshfuse", *sys.argv[1:]])  # its usage lines say "meshfuse"


if __name__ == "__main__":
    main()
