#!/usr/bin/env python3
"""The images of the real node (``make e2e``): a local base, and the bake's own image on it.

No registry is reachable from CI, so the Dockerfile's digest-pinned ``python:*-slim`` cannot be
pulled. The base is made here instead, once per machine and cached beside the engines:
``debootstrap --variant=minbase`` of Debian bookworm with its ``python3``, ``python3-pip`` and
``libseccomp2`` (the sandbox's), imported into buildah's store as ``localhost/e2e-base:<key>``.
Debian's Python differs from the official image in two ways the Dockerfile relies on, both
settled in the base, not in the Dockerfile: pip refuses to install beside Debian's packages
(``EXTERNALLY-MANAGED``, removed) and ``pip install --prefix=/install`` lays out under
``/install/local/`` (``DEB_PYTHON_INSTALL_LAYOUT=deb_system`` makes it ``/install/bin`` and
``/install/lib/python3/dist-packages``, and a ``.pth`` puts ``/usr/local``'s on ``sys.path``).

The bake's image is its own Dockerfile built by buildah with ``--build-arg BASE_IMAGE`` (the
Dockerfile's documented way to an air-gapped base); :func:`image_archive` saves it as an OCI
archive for containerd (``ctr images import``).

buildah's store is a folder of the cache (``containers/``), never the system's
``/var/lib/containers``; builds run at ``nice 15``. ``--network host`` (builds fetch from
PyPI and Debian) and the host's CA bundle mounted read-only (what this machine's pip trusts).

Usage: ``images.py [--base-only]`` builds the base (cached) and, without ``--base-only``, a
fresh bake's image, printing each step's time.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import build

SUITE = "bookworm"
MIRROR = os.environ.get("E2E_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ("python3", "python3-pip", "libseccomp2", "ca-certificates")
#: The environment of the base (see the module doc).
BASE_ENV = {
    "DEB_PYTHON_INSTALL_LAYOUT": "deb_system",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
PTH = "/usr/lib/python3/dist-packages/zz-usr-local.pth"
PTH_LINE = "/usr/local/lib/python3/dist-packages\n"
#: What podman/buildah need on this machine kind (no CAP_SYS_RESOURCE: the defaults exceed
#: the hard limits it may not raise).
ULIMITS = ("--ulimit", "nofile=10000:10000", "--ulimit", "nproc=5000:5000")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
#: Where a build finds the runtime's wheel (:func:`runtime_wheels`).
WHEELS = "/e2e-wheels"
TEMPLATE = HERE.parents[1]


def recipe_key() -> str:
    """The base's cache key: a hash of everything that makes it."""
    recipe = "|".join(
        (
            SUITE,
            MIRROR,
            *PACKAGES,
            *sorted(f"{k}={v}" for k, v in BASE_ENV.items()),
            PTH,
            PTH_LINE,
        )
    )
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def base_ref() -> str:
    return f"localhost/e2e-base:{SUITE}-{recipe_key()}"


def store(cache: Path) -> list[str]:
    """buildah's global options: its store in the cache."""
    root = cache / "containers"
    return [
        "--root",
        str(root / "storage"),
        "--runroot",
        str(root / "run"),
        "--storage-driver",
        "overlay",
    ]


def buildah(cache: Path, *args: str, capture: bool = False) -> str:
    cmd = ["nice", "-n", "15", "buildah", *store(cache), *args]
    print(f"[image] buildah {' '.join(args)}", file=sys.stderr, flush=True)
    done = subprocess.run(
        cmd, check=True, text=True, stdout=subprocess.PIPE if capture else sys.stderr
    )
    return (done.stdout or "").strip()


def has_image(cache: Path, ref: str) -> bool:
    done = subprocess.run(
        ["buildah", *store(cache), "inspect", "--type", "image", ref],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def base_image(cache: Path) -> str:
    """The local base (built once: debootstrap, then imported); its reference."""
    ref = base_ref()
    if has_image(cache, ref):
        print(f"[image] {ref}: cached", file=sys.stderr, flush=True)
        return ref
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="e2e-base-", dir=cache) as tmp:
        root = Path(tmp) / "root"
        subprocess.run(
            [
                "nice",
                "-n",
                "15",
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(root),
                MIRROR,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        for managed in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            managed.unlink()
        (root / PTH.lstrip("/")).write_text(PTH_LINE)
        for folder in (
            "var/lib/apt/lists",
            "var/cache/apt",
            "usr/share/doc",
            "usr/share/man",
            "usr/share/info",
            "usr/share/locale",
        ):
            shutil.rmtree(root / folder, ignore_errors=True)
        (root / "var/lib/apt/lists/partial").mkdir(parents=True)
        tar = Path(tmp) / "base.tar"
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(root), "-cf", str(tar), "."],
            check=True,
        )
        container = buildah(cache, "from", "scratch", capture=True)
        try:
            buildah(cache, "add", container, str(tar), "/")
            env = [a for k, v in BASE_ENV.items() for a in ("--env", f"{k}={v}")]
            buildah(cache, "config", *env, "--cmd", "python3", container)
            buildah(cache, "commit", "--rm", container, ref)
        except BaseException:
            subprocess.run(["buildah", *store(cache), "rm", container], check=False)
            raise
        size = tar.stat().st_size
    print(
        f"[image] {ref}: built in {time.monotonic() - started:.0f} s "
        f"({size / 1e6:.0f} MB tar)",
        flush=True,
    )
    return ref


def pause_image(cache: Path) -> str:
    """The pods' sandbox image (no registry: no ``registry.k8s.io/pause``): the base whose
    command sleeps; containerd stops a sandbox with SIGKILL."""
    ref = f"localhost/e2e-pause:{SUITE}-{recipe_key()}"
    if has_image(cache, ref):
        return ref
    container = buildah(cache, "from", base_image(cache), capture=True)
    buildah(cache, "config", "--cmd", "sleep infinity", "--entrypoint", "[]", container)
    buildah(cache, "commit", "--rm", container, ref)
    return ref


def runtime_wheels(cache: Path, work: Path) -> Path:
    """A folder with the wheel of this checkout's ``runtime/`` (worker-runtime, which a bake
    pins and no index serves), and a ``pip.conf`` that makes pip look there."""
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    source = work / "runtime"  # a copy: a build writes build/ beside its sources
    shutil.copytree(
        TEMPLATE / "runtime",
        source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests", "docs"),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(wheels),
            str(source),
        ],
        check=True,
        stdout=sys.stderr,
    )
    (work / "pip.conf").write_text(f"[global]\nfind-links = {WHEELS}\n")
    return work


def bake_image(cache: Path, project: Path, ref: str) -> str:
    """The bake's Dockerfile built on the local base as ``ref``: the Dockerfile as baked, its
    ``pip install`` finding worker-runtime in this checkout's wheel (mounted with a
    ``/etc/pip.conf`` for the build only, not in the image)."""
    base = base_image(cache)
    started = time.monotonic()
    extra = runtime_wheels(cache, project.parent / "e2e-wheels")
    buildah(
        cache,
        "bud",
        "--network",
        "host",
        *ULIMITS,
        "--layers",
        "--volume",
        f"{CA_BUNDLE}:{CA_BUNDLE}:ro",
        "--volume",
        f"{extra / 'wheels'}:{WHEELS}:ro",
        "--volume",
        f"{extra / 'pip.conf'}:/etc/pip.conf:ro",
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--tag",
        ref,
        str(project),
    )
    print(
        f"[image] {ref}: built in {time.monotonic() - started:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return ref


def image_archive(cache: Path, ref: str) -> Path:
    """``ref`` saved as an OCI archive (what ``ctr images import`` reads), once per image
    id, in the cache's ``images/``."""
    image_id = buildah(
        cache, "images", "--format", "{{.ID}}", "--noheading", ref, capture=True
    ).split()[0]
    dest = (
        cache / "images" / f"{ref.rsplit('/', 1)[-1].replace(':', '-')}-{image_id}.tar"
    )
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    for old in dest.parent.glob(f"{ref.rsplit('/', 1)[-1].replace(':', '-')}-*.tar"):
        old.unlink()
    partial = dest.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    buildah(cache, "push", ref, f"oci-archive:{partial}:{ref}")
    partial.rename(dest)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-only", action="store_true")
    args = parser.parse_args()
    missing = [t for t in ("buildah", "debootstrap") if shutil.which(t) is None]
    missing += ["root"] if os.geteuid() != 0 else []
    if missing:
        print(
            f"[image] the real node's images need {', '.join(missing)} (.ci/run installs "
            "them): not built",
            file=sys.stderr,
        )
        return 1 if os.environ.get("CI") else 0
    cache = build.cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    base_image(cache)
    if not args.base_only:
        import run

        with tempfile.TemporaryDirectory(prefix="e2e-image-") as tmp:
            project = run.bake(Path(tmp))
            bake_image(cache, project, f"localhost/{run.PROJECT}:e2e")
    return 0


if __name__ == "__main__":
    sys.exit(main())
