"""EngineProcess's temporary directory: the pinned vLLM leaves a vllm_dist_<hex> file in TMPDIR per engine and never
removes it (found by make test's TMPDIR check), so each engine process runs with a TMPDIR of its own that goes when
the engine ends. No engine is started here: the process is killed while it is still importing."""
from __future__ import annotations

import tempfile
from pathlib import Path

from kmesh.vllm.engine import EngineProcess


def test_an_engine_has_a_temporary_directory_of_its_own_removed_when_it_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)        # tempfile caches the first TMPDIR it saw
    engines = [EngineProcess(tmp_path / "no-model", None, wait=False) for _ in range(2)]
    a, b = engines
    assert a.tmpdir != b.tmpdir and {a.tmpdir.parent, b.tmpdir.parent} == {tmp_path}
    for eng in engines:
        environ = Path(f"/proc/{eng.pid}/environ").read_bytes().split(b"\0")
        assert f"TMPDIR={eng.tmpdir}".encode() in environ
        (eng.tmpdir / "vllm_dist_0123456789abcdef0123456789abcdef").write_text("what vLLM leaves")
    a.kill()
    assert not a.tmpdir.exists() and b.tmpdir.is_dir()      # one engine's end removes its own directory only
    b.kill()
    assert list(tmp_path.iterdir()) == []
