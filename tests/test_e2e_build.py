"""scripts/e2e/build.py without building: the wrapper module's replaces, the cache key, and
a cached engine reused without running Go (offline)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bakery import TEMPLATE

E2E = TEMPLATE / "scripts" / "e2e"
sys.path.insert(0, str(E2E))
import build  # noqa: E402


def test_local_replaces_become_the_pinned_versions() -> None:
    """k8s.io/kubernetes replaces its staging modules by ./staging/...; the wrapper pins
    them to v0.35.4. A replace by another module is copied, versions included."""
    k8s = build.ENGINES["k8s"]
    replaces = [
        {"Old": {"Path": "k8s.io/api"}, "New": {"Path": "./staging/src/k8s.io/api"}},
        {"Old": {"Path": "github.com/atotto/clipboard"},
         "New": {"Path": "github.com/tgummerer/clipboard", "Version": "v0.0.0-2024"}},
        {"Old": {"Path": "example.com/x", "Version": "v1.0.0"},
         "New": {"Path": "example.com/y", "Version": "v1.2.0"}},
    ]
    assert build.replace_args(k8s, replaces) == [
        "-replace=k8s.io/api=k8s.io/api@v0.35.4",
        "-replace=github.com/atotto/clipboard=github.com/tgummerer/clipboard@v0.0.0-2024",
        "-replace=example.com/x@v1.0.0=example.com/y@v1.2.0",
    ]
    provider = build.ENGINES["provider"]
    sdk = {"Old": {"Path": "github.com/pulumi/pulumi-kubernetes/sdk/v4"}, "New": {"Path": "../sdk"}}
    assert build.replace_args(provider, [sdk]) == [
        "-replace=github.com/pulumi/pulumi-kubernetes/sdk/v4="
        "github.com/pulumi/pulumi-kubernetes/sdk/v4@v4.24.0"
    ]


def test_the_cache_is_keyed_by_the_versions(tmp_path: Path) -> None:
    env = {**os.environ, "E2E_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, str(E2E / "build.py"), "--bin-dirs"], env=env,
                         check=True, capture_output=True, text=True).stdout.split()
    assert out == [str(tmp_path / "bin" / e.key) for e in build.ENGINES.values()]
    assert [Path(p).name for p in out] == [
        "k8s-v1.35.4", "kubelet-v1.35.4", "kwok-v0.7.0", "pulumi-v3.274.1",
        "provider-v4.0.0-20260115033456-f47bc2d6f199", "keda-v2.21.0"]


def test_a_built_engine_is_reused_without_go(tmp_path: Path) -> None:
    """With every bin/<engine>-<version>/.ok present, build.py runs no go command: PATH
    holds no go at all and it still succeeds, naming each cached folder."""
    for engine in build.ENGINES.values():
        (tmp_path / "bin" / engine.key).mkdir(parents=True)
        (tmp_path / "bin" / engine.key / ".ok").write_text("built\n")
    env = {**os.environ, "E2E_CACHE": str(tmp_path), "PATH": "/nonexistent"}
    done = subprocess.run([sys.executable, str(E2E / "build.py")], env=env,
                          check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": cached in ") == len(build.ENGINES), done.stdout


def test_an_unfinished_engine_is_built_again(tmp_path: Path) -> None:
    """A bin folder without .ok (a build stopped half way) is not taken for a build."""
    (tmp_path / "bin" / "kwok-v0.7.0").mkdir(parents=True)
    (tmp_path / "bin" / "kwok-v0.7.0" / "kwok").write_text("half")
    env = {**os.environ, "E2E_CACHE": str(tmp_path), "PATH": "/nonexistent"}
    done = subprocess.run([sys.executable, str(E2E / "build.py"), "--engines", "kwok"],
                          env=env, check=False, capture_output=True, text=True)
    assert done.returncode != 0
    assert "cached in" not in done.stdout
    assert "[build] go mod init" in done.stdout, done.stdout
