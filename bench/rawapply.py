"""Time raw tool commands from INSIDE a namespace (so that ``ip netns exec`` and Python start-up are
not counted, as they are not for netproxy's own tool calls).

    python -m bench.rawapply '[{"argv": ["nft", "-f", "/tmp/x.nft"]}, {"argv": [...], "stdin": "/tmp/y"}]'

A command with ``"untimed": true`` runs but is not counted (creating the ipsets a payload names).
Runs the commands one after the other and prints ``{"seconds": total, "steps": [...], "rc": first
non-zero exit or 0, "stderr": "..."}``; stops at the first failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence


def run(spec: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    steps: List[float] = []
    for cmd in spec:
        stdin = open(cmd["stdin"], "rb") if cmd.get("stdin") else subprocess.DEVNULL  # noqa: SIM115
        try:
            t0 = time.perf_counter()
            proc = subprocess.run(cmd["argv"], stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  check=False)
            if not cmd.get("untimed"):
                steps.append(time.perf_counter() - t0)
        finally:
            if stdin is not subprocess.DEVNULL:
                stdin.close()  # type: ignore[union-attr]
        if proc.returncode != 0:
            return {"seconds": sum(steps), "steps": steps, "rc": proc.returncode,
                    "stderr": proc.stderr.decode(errors="replace")[-1500:]}
    return {"seconds": sum(steps), "steps": steps, "rc": 0, "stderr": ""}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    result = run(json.loads(args[0]))
    print(json.dumps(result))
    return 0 if result["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
