"""Render a stack's Kubernetes objects offline (Pulumi's mocks; no CLI, no cluster).

    python infra/render.py [STACK] [-o PATH]     (``make manifests STACK=<env>``)

Writes ``build/manifests/<STACK>.yaml``, one YAML document per object. Secret values are
never decrypted: they render as ``<secret>``. A stack that a guard refuses prints one line
naming the pools and numbers and exits 1.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import Any

from worker_infra.errors import GuardError
from worker_infra.render import read_stack, render, to_yaml

INFRA = Path(__file__).resolve().parent
ROOT = INFRA.parent
#: Secrets the program requires; `pulumi config set --secret` stores them in the stack file.
SECRETS = ("redisPassword", "databaseUrl", "sandboxRedisPassword")


def stack_objects(stack: str) -> list[dict[str, Any]]:
    """The stack's Kubernetes objects, rendered offline (raises ``GuardError`` if refused)."""
    files = read_stack(INFRA, stack, secrets=SECRETS)
    return render(
        lambda: runpy.run_path(str(INFRA / "__main__.py"), run_name="__main__"),
        project=files.project,
        stack=files.stack,
        config=files.config,
        secret_keys=files.secret_keys,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render a stack's Kubernetes objects offline.")
    parser.add_argument("stack", nargs="?", default="dev", help="stack name (default: dev)")
    parser.add_argument("-o", "--output", type=Path, help="default: build/manifests/<stack>.yaml")
    args = parser.parse_args(argv)
    try:
        objects = stack_objects(args.stack)
    except (GuardError, FileNotFoundError) as error:
        message = " ".join(str(error).split())
        print(f"manifests: stack {args.stack!r} refused: {message}", file=sys.stderr)
        return 1
    output = args.output or ROOT / "build" / "manifests" / f"{args.stack}.yaml"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(to_yaml(objects), encoding="utf-8")
    print(f"wrote {output} ({len(objects)} objects)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
