#!/usr/bin/env python3
"""Build the real engines `make e2e` runs, once per machine, into a cache outside the clone.

Each engine is a Go module at a pinned version, built from the Go module proxy by the local Go
toolchain in a wrapper module of ours (``go install mod@version`` refuses modules with
``replace`` directives, so the wrapper copies them: a relative replace of module M becomes M at
the engine's pinned version). Nothing upstream is kept in the clone.

Layout of the cache (``E2E_CACHE``, default ``~/.cache/worker-template-e2e``)::

    go/mod, go/build          GOMODCACHE and GOCACHE of these builds only
    src/<engine>-<version>/   the wrapper module (go.mod, go.sum, generated files)
    bin/<engine>-<version>/   the binaries, and ``.ok`` once they are all built

A present ``bin/<engine>-<version>/.ok`` is reused without running Go (offline once built).
Builds run at ``nice 19`` with ``go build -p <cores>`` (``E2E_BUILD_JOBS``); nice keeps the machine usable.

Usage: ``build.py [--engines k8s,kubelet,kwok,pulumi,provider,keda] [--bin-dirs]``; ``--bin-dirs`` prints the
bin folders (one a line, for PATH) and builds nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

K8S_VERSION = "v1.35.4"
K8S_STAGING_VERSION = "v0.35.4"
KWOK_VERSION = "v0.7.0"
PULUMI_VERSION = "v3.274.1"
# The only version of provider/v4 the proxy serves; its sdk/v4 replace points at sdk v4.24.0.
PROVIDER_VERSION = "v4.0.0-20260115033456-f47bc2d6f199"
PROVIDER_SDK_VERSION = "v4.24.0"
KEDA_VERSION = "v2.21.0"
# The version the provider reports (and writes into its schema): the SDK release it matches.
PROVIDER_REPORTED = PROVIDER_SDK_VERSION.lstrip("v")


def cache_dir() -> Path:
    """The cache folder: ``E2E_CACHE`` or ``~/.cache/worker-template-e2e``."""
    env = os.environ.get("E2E_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "worker-template-e2e"


@dataclass(frozen=True)
class Engine:
    """One Go module built at one version.

    :param name: short name (also the folder prefix).
    :param module: the upstream module path.
    :param version: the pinned version of ``module``.
    :param packages: main packages to build, relative to ``module`` (binary = last element).
    :param local_versions: version for a relative ``replace`` of a module path (default: version).
    :param ldflags: ``-X`` stamps.
    :param copy_packages: packages copied into the wrapper module before building (they need
        files generated beside their sources); built from there.
    """

    name: str
    module: str
    version: str
    packages: tuple[str, ...]
    local_versions: dict[str, str] = field(default_factory=dict)
    ldflags: tuple[str, ...] = ()
    copy_packages: tuple[str, ...] = ()
    default_local_version: str = ""

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


def _k8s_ldflags() -> tuple[str, ...]:
    major, minor = K8S_VERSION.lstrip("v").split(".")[:2]
    stamps = {
        "gitVersion": K8S_VERSION,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    return tuple(
        f"-X {pkg}.{k}={v}"
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for k, v in stamps.items()
    )


_K8S = Engine(
    name="k8s",
    module="k8s.io/kubernetes",
    version=K8S_VERSION,
    packages=("cmd/kube-apiserver", "cmd/kube-controller-manager", "cmd/kube-scheduler"),
    default_local_version=K8S_STAGING_VERSION,
    ldflags=_k8s_ldflags(),
)

ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        _K8S,
        # The real node's kubelet (make e2e): its own wrapper, the same module graph as
        # k8s, so the build cache has all but ~100 of its packages once k8s is built (36 s).
        dataclasses.replace(_K8S, name="kubelet", packages=("cmd/kubelet",)),
        Engine(
            name="kwok",
            module="sigs.k8s.io/kwok",
            version=KWOK_VERSION,
            packages=("cmd/kwok",),
            default_local_version=KWOK_VERSION,
            ldflags=(f"-X sigs.k8s.io/kwok/pkg/consts.Version={KWOK_VERSION}",),
        ),
        Engine(
            name="pulumi",
            module="github.com/pulumi/pulumi/pkg/v3",
            version=PULUMI_VERSION,
            packages=("cmd/pulumi",),
            default_local_version=PULUMI_VERSION,
            ldflags=(f"-X github.com/pulumi/pulumi/sdk/v3/go/common/version.Version={PULUMI_VERSION}",),
        ),
        Engine(
            name="provider",
            module="github.com/pulumi/pulumi-kubernetes/provider/v4",
            version=PROVIDER_VERSION,
            packages=("cmd/pulumi-resource-kubernetes",),
            default_local_version=PROVIDER_SDK_VERSION,
            copy_packages=("cmd/pulumi-resource-kubernetes",),
            ldflags=(
                "-X github.com/pulumi/pulumi-kubernetes/provider/v4/pkg/version.Version="
                + PROVIDER_REPORTED,
            ),
        ),
        # KEDA's operator and metrics adapter (the real node's autoscaling, #43: built and cached; no scenario runs them yet). v2.21.1 wants Go
        # 1.27; v2.21.2 and v2.22.0 are refused by the module proxy.
        Engine(
            name="keda",
            module="github.com/kedacore/keda/v2",
            version=KEDA_VERSION,
            packages=("cmd/operator", "cmd/adapter"),
            default_local_version=KEDA_VERSION,
            ldflags=(f"-X github.com/kedacore/keda/v2/version.Version={KEDA_VERSION}",),
        ),
    )
}


#: The engines of the kwok node's scenarios; the others (kubelet, KEDA) are the real node's.
KWOK_E2E = ("k8s", "kwok", "pulumi", "provider")


def go_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GOMODCACHE=str(cache / "go" / "mod"),
        GOCACHE=str(cache / "go" / "build"),
        GOPATH=str(cache / "go" / "path"),
        GOTOOLCHAIN="local",
        GOFLAGS="-mod=mod -buildvcs=false",
        CGO_ENABLED="0",
        GOWORK="off",
    )
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str], capture: bool = False) -> str:
    print(f"[build] {' '.join(cmd)}", flush=True)
    done = subprocess.run(
        ["nice", "-n", "19", *cmd],
        cwd=cwd,
        env=env,
        check=True,
        text=True,
        stdout=subprocess.PIPE if capture else None,
    )
    return done.stdout or ""


def upstream_replaces(engine: Engine, cache: Path, env: dict[str, str]) -> list[str]:
    """``go mod edit -replace`` arguments copied from the upstream go.mod."""
    info = json.loads(
        run(["go", "mod", "download", "-json", f"{engine.module}@{engine.version}"],
            cache, env, capture=True)
    )
    mod = json.loads(run(["go", "mod", "edit", "-json", info["GoMod"]], cache, env, capture=True))
    return replace_args(engine, mod.get("Replace") or [])


def replace_args(engine: Engine, replaces: list[dict[str, Any]]) -> list[str]:
    """``go mod edit -replace`` arguments for the ``Replace`` list of ``go mod edit -json``:
    a replace by a local path (``./staging/src/k8s.io/api``, ``../sdk``) becomes the same
    module at the engine's pinned version (:attr:`Engine.local_versions`, default
    :attr:`Engine.default_local_version`); any other is copied as it is."""
    args = []
    for rep in replaces:
        old, new = rep["Old"], rep["New"]
        lhs = old["Path"] + (f"@{old['Version']}" if old.get("Version") else "")
        if new["Path"].startswith("."):
            version = engine.local_versions.get(old["Path"], engine.default_local_version)
            rhs = f"{old['Path']}@{version}"
        else:
            rhs = new["Path"] + (f"@{new['Version']}" if new.get("Version") else "")
        args.append(f"-replace={lhs}={rhs}")
    return args


def copy_package(engine: Engine, pkg: str, src: Path, env: dict[str, str]) -> Path:
    """Copy an upstream main package into the wrapper and generate what it embeds."""
    info = json.loads(
        run(["go", "mod", "download", "-json", f"{engine.module}@{engine.version}"],
            src, env, capture=True)
    )
    upstream = Path(info["Dir"])
    dest = src / pkg
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(upstream / pkg, dest)
    for p in dest.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    if engine.name == "provider":
        # generate.go writes these from the module's schema.json (with the version set) and
        # terraform-mapping.json; the binary embeds them.
        schema = json.loads((upstream / pkg / "schema.json").read_text())
        schema["version"] = PROVIDER_REPORTED
        (dest / "schema-embed.json").write_text(json.dumps(schema))
        mapping = upstream / pkg / "terraform-mapping.json"
        shutil.copyfile(mapping, dest / "terraform-mapping-embed.json")
        for gen in dest.glob("generate*.go"):
            gen.unlink()
    return dest


def children_cpu_s() -> float:
    """User + system CPU seconds of the finished child processes (the go commands)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def build_jobs() -> str:
    """``go build -p``: ``E2E_BUILD_JOBS``, default every core (the build runs at nice 19, so
    what else runs keeps its share; ``-p 1`` left one of two cores idle on a quiet machine)."""
    return os.environ.get("E2E_BUILD_JOBS") or str(os.cpu_count() or 1)


def build(engine: Engine, cache: Path) -> Path:
    bindir = cache / "bin" / engine.key
    if (bindir / ".ok").exists():
        print(f"[build] {engine.key}: cached in {bindir}", flush=True)
        return bindir
    env = go_env(cache)
    src = cache / "src" / engine.key
    src.mkdir(parents=True, exist_ok=True)
    bindir.mkdir(parents=True, exist_ok=True)
    started, cpu = time.monotonic(), children_cpu_s()
    if not (src / "go.mod").exists():
        run(["go", "mod", "init", f"e2e.local/{engine.name}"], src, env)
        run(["go", "mod", "edit", f"-require={engine.module}@{engine.version}",
             *upstream_replaces(engine, cache, env)], src, env)
    for pkg in engine.packages:
        target: str = f"{engine.module}/{pkg}"
        if pkg in engine.copy_packages:
            copy_package(engine, pkg, src, env)
            target = f"./{pkg}"
        out = bindir / pkg.rsplit("/", 1)[-1]
        run(["go", "build", "-p", build_jobs(), "-trimpath", "-ldflags", " ".join(["-s", "-w", *engine.ldflags]),
             "-o", str(out), target], src, env)
    took = f"built in {time.monotonic() - started:.0f} s, {children_cpu_s() - cpu:.0f} CPU s"
    (bindir / ".ok").write_text(took + "\n")
    print(f"[build] {engine.key}: {took}", flush=True)
    return bindir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--bin-dirs", action="store_true")
    args = parser.parse_args()
    cache = cache_dir()
    names = [n for n in args.engines.split(",") if n]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        print(f"build.py: unknown engine {unknown}; known: {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    if args.bin_dirs:
        for n in names:
            print(cache / "bin" / ENGINES[n].key)
        return 0
    for n in names:
        build(ENGINES[n], cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
