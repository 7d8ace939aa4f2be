"""Confined fs/* calls against unconfined ones, in one run, over stdio.

Each confined call runs on a fresh thread that confines itself (a private
mount namespace, or Landlock) before the operation (docs/filesystem.md,
"Under a sandbox"). This prints, for ``fs/getMetadata`` and a 1 KiB
``fs/writeFile`` inside the writable root, at depth 1 and 16, the rate of
the call with ``{"mode": "workspaceWrite", "writableRoots": [ROOT]}`` (and,
for getMetadata, Codex's profile with a hidden path, which confines reads
too) as a ratio to the same call without a sandbox, for each mechanism;
the same server serves both, alternating within each round. Never asserts.

Usage: ``python bench/bench_sandbox_fs.py [--rounds 3] [--count 2000]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._client import Ratio, Series, StdioClient, print_header
from bench.bench_rtt import pipelined_rate

MECHANISMS = ("mount-namespace", "landlock")
DEPTHS = (1, 16)


def _profile(root: Path, hidden: Path) -> dict[str, object]:
    """Codex's workspace-write profile with ``hidden`` not readable (``none``)."""
    entries = [
        {"path": {"type": "special", "value": {"kind": "root"}}, "access": "read"},
        {"path": {"type": "special", "value": {"kind": "project_roots"}}, "access": "write"},
        {"path": {"type": "path", "path": "file://" + str(hidden)}, "access": "none"},
    ]
    return {
        "permissions": {
            "type": "managed",
            "file_system": {"type": "restricted", "entries": entries},
            "network": "restricted",
        },
        "cwd": "file://" + str(root),
        "workspaceRoots": ["file://" + str(root)],
        "windowsSandboxLevel": "disabled",
    }


def templates(root: Path) -> dict[str, tuple[bytes, bytes]]:
    """(unconfined, confined) request templates per case (``%d``: the id)."""
    mode = json.dumps({"mode": "workspaceWrite", "writableRoots": [str(root)]})
    with_hidden = json.dumps(_profile(root, root / "hidden"))
    path = json.dumps(str(root / "f.txt"))
    data = json.dumps("A" * 1368)  # 1 KiB of base64 text's bytes, 1026 decoded
    out: dict[str, tuple[bytes, bytes]] = {}
    for case, method, params, sandbox in (
        ("fs/getMetadata (root readable)", "fs/getMetadata", f'"path":{path}', mode),
        ("fs/getMetadata (a hidden path)", "fs/getMetadata", f'"path":{path}', with_hidden),
        ("fs/writeFile 1 KiB", "fs/writeFile", f'"path":{path},"dataBase64":{data}', mode),
    ):
        plain = '{"id":%d,"method":"' + method + '","params":{' + params + "}}\n"
        confined = (
            '{"id":%d,"method":"' + method + '","params":{' + params + ',"sandbox":' + sandbox
        )
        out[case] = (plain.encode(), (confined + "}}\n").encode())
    return out


def run(rounds: int, count: int) -> list[Ratio]:
    root = Path(tempfile.mkdtemp(prefix="bench-sandbox-", dir="/var/tmp"))
    (root / "f.txt").write_bytes(b"x")
    (root / ".git").mkdir()
    (root / "hidden").mkdir()
    ratios: list[Ratio] = []
    try:
        for mechanism in MECHANISMS:
            os.environ["EXECSERVER_FS_SANDBOX_MECHANISM"] = mechanism
            with StdioClient() as client:
                client.initialize()
                for case, (plain, confined) in templates(root).items():
                    pipelined_rate(client, 50, 1, plain)  # warm-up: the pool starts
                    pipelined_rate(client, 50, 1, confined)  # the mechanism is probed
                    for depth in DEPTHS:
                        n = count if depth > 1 else count // 4
                        free: list[float] = []
                        held: list[float] = []
                        for _ in range(rounds):
                            free.append(pipelined_rate(client, n, depth, plain))
                            held.append(pipelined_rate(client, n, depth, confined))
                        ratios.append(
                            Ratio(
                                f"{case}, depth {depth}, {mechanism}: confined / unconfined",
                                Series(f"confined {case}", "req/s", tuple(held)),
                                Series(f"unconfined {case}", "req/s", tuple(free)),
                            )
                        )
    finally:
        os.environ.pop("EXECSERVER_FS_SANDBOX_MECHANISM", None)
        shutil.rmtree(root, ignore_errors=True)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=2000)
    args = parser.parse_args()
    print_header("fs/* under a sandbox (stdio)")
    for ratio in run(args.rounds, args.count):
        print(ratio.describe(), flush=True)


if __name__ == "__main__":
    main()
