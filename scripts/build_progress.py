"""Shows the progress of `pip install -v -e .` (the build of graphfp8._C) as one short line per
compiled file, instead of minutes of silence or pages of compiler flags; on failure, the end of
pip's output. Exit status: 0 when pip reported success, else 1.

    pip install --no-build-isolation --no-deps -v -e . 2>&1 | python scripts/build_progress.py
"""

from __future__ import annotations

import re
import sys
from collections import deque

# ninja's "[3/16] c++ ... -c -c /path/csrc/cpu/rope.cpp -o ..." (nvcc lines alike)
STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s.*\s(\S+\.(?:cpp|cu))\s+-o\s")
SUCCESS = "Successfully installed graphfp8"


def main() -> int:
    tail: deque[str] = deque(maxlen=60)
    ok = False
    for line in sys.stdin:
        tail.append(line)
        step = STEP.match(line)
        if step:
            done, total, source = step.groups()
            path = source.split("csrc/", 1)[-1]
            print(f"   [{done}/{total}] compiling csrc/{path}", flush=True)
        elif SUCCESS in line:
            ok = True
    if ok:
        print("   graphfp8 installed (editable), graphfp8._C built", flush=True)
        return 0
    sys.stdout.write("".join(tail))
    print("== the editable install of graphfp8 failed (pip's output above)", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
