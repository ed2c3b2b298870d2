"""One pinned distribution file, from the cache or from the index, always verified against the lock.

A cached file is reused only when its sha256 equals the pin (then nothing touches the network). A
download lands in a staging folder first and enters the cache only once verified; a file that fails
verification stays where it is and the error names it. Which file pip picks is fixed by the wheel
target (Python version, ABI, platform), not by the machine running this, so the lock's digest applies
on any host.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from kmesh.pins import Pin, canonical
from kmesh.sources import HashMismatchError, NetworkUnavailableError, SourcesError
from kmesh.sources.digest import sha256_file

DEFAULT_INDEX = "https://pypi.org/simple"
STAGING = ".download"


@dataclass(frozen=True)
class WheelTarget:
    """The interpreter/platform whose wheel the lock pins (pip download --python-version/--abi/--platform)."""

    python_version: str
    abi: str
    platform: str
    implementation: str = "cp"

    def pip_args(self) -> list[str]:
        return ["--python-version", self.python_version, "--implementation", self.implementation,
                "--abi", self.abi, "--platform", self.platform]


@dataclass(frozen=True)
class Fetched:
    pin: Pin
    path: Path
    sha256: str
    reused: bool          # True: a verified cached file was used and nothing was downloaded
    kind: str = "wheel"


class DownloadFailed(SourcesError):
    """pip download exited non-zero; the message holds the tail of its output."""


def wheels_for(pin: Pin, folder: Path) -> list[Path]:
    """Wheel files in `folder` whose file name says this pin's name and version."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import Version

    found = []
    if not folder.is_dir():
        return found
    for p in sorted(folder.glob("*.whl")):
        try:
            name, version, _, _ = parse_wheel_filename(p.name)
        except InvalidWheelFilename:
            continue
        if canonical(name) == pin.name and version == Version(pin.version):
            found.append(p)
    return found


def pip_download(pin: Pin, dest: Path, target: WheelTarget) -> None:
    """`pip download --no-deps --only-binary :all:` of exactly this pin into `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", *target.pip_args(),
           "--timeout", "20", "--retries", "1", "--no-input", "--disable-pip-version-check", "--quiet",
           "-d", str(dest), f"{pin.name}=={pin.version}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        # pip's configured flat extra indexes warn once per package; that noise hides the real error.
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "is ignored: it is neither" not in ln]
        raise DownloadFailed(f"pip download {pin.name}=={pin.version} failed (exit {out.returncode}): "
                             + "\n".join(lines[-15:]))


def index_reachable(timeout: float = 5.0) -> tuple[bool, str]:
    """Can a TCP connection reach the package index ($PIP_INDEX_URL, else PyPI)? (ok, what was tried)."""
    url = urlparse(os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX)
    if url.scheme == "file":
        return Path(url.path).exists(), url.geturl()
    host, port = url.hostname or "pypi.org", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return False, f"{host}:{port} ({e})"
    return True, f"{host}:{port}"


def fetch(pin: Pin, cache_dir: Path, target: WheelTarget, pinned_by: str = "the lock",
          download: Callable[[Pin, Path, WheelTarget], None] = pip_download,
          reachable: Callable[[], tuple[bool, str]] = index_reachable) -> Fetched:
    """The verified wheel of `pin` in `cache_dir`: a cached one if it verifies, else a fresh download.

    Raises HashMismatchError (a cached or downloaded file with another digest; the file is kept),
    NetworkUnavailableError (nothing cached and the index unreachable), DownloadFailed (other pip errors).
    """
    cached = wheels_for(pin, cache_dir)
    if cached:
        digests = {p: sha256_file(p) for p in cached}
        for p, sha in digests.items():
            if sha == pin.sha256:
                return Fetched(pin, p, sha, reused=True)
        bad = cached[0]
        raise HashMismatchError(str(bad), pin.sha256, digests[bad],
                                f"{pinned_by}; delete the cached file to download it again")
    staging = cache_dir / STAGING / f"{pin.name}-{pin.version}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        download(pin, staging, target)
    except DownloadFailed as e:
        ok, where = reachable()
        if not ok:
            raise NetworkUnavailableError(
                f"cannot download {pin.name}=={pin.version}: the index is unreachable ({where}) and no verified "
                f"file is cached in {cache_dir}") from e
        raise
    got = wheels_for(pin, staging)
    if len(got) != 1:
        raise SourcesError(f"pip download of {pin.name}=={pin.version} left {len(got)} matching wheels in "
                           f"{staging}: {[p.name for p in got]}")
    sha = sha256_file(got[0])
    if sha != pin.sha256:
        raise HashMismatchError(str(got[0]), pin.sha256, sha, pinned_by)
    final = cache_dir / got[0].name
    os.replace(got[0], final)
    shutil.rmtree(staging, ignore_errors=True)
    return Fetched(pin, final, sha, reused=False)
