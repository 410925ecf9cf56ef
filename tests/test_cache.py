"""``dpr-gc cache`` lists the parsed-data cache ($DPR_GC_CACHE or ~/.cache/dpr_gc) and ``--clear`` empties it,
keeping a cache another run is building; the next run parses its source again."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from dpr_gc.base.files import atomic_path
from dpr_gc.cli import main
from dpr_gc.data.arrow_cache import default_cache_dir
from dpr_gc.data.corpus import load_corpus
from tests.helpers import summary_rows

EXAMPLES = Path(__file__).resolve().parent.parent / "data" / "examples"


def test_cache_lists_and_clears(tmp_path: Path, monkeypatch, capsys) -> None:
    """Both end with the closing summary every command prints (they printed none): the sources, MiB and folder of
    the listing; what --clear removed, freed and kept."""
    monkeypatch.setenv("DPR_GC_CACHE", str(tmp_path / "cache"))
    load_corpus(EXAMPLES / "passages.tsv")
    assert main(["cache"]) == 0
    listing = capsys.readouterr().out
    assert "| corpora | 1 |" in listing and str(tmp_path / "cache" / "corpora") in listing
    listed = summary_rows(listing)
    assert (listed["sources"], listed["folder"]) == ("1", str(tmp_path / "cache")) and "MiB" in listed, listed
    busy = tmp_path / "cache" / "train" / "t-0123456789abcdef.arrow"  # named as cache_file names one
    busy.parent.mkdir(parents=True)
    with open(str(busy) + ".lock", "w") as held, atomic_path(busy) as tmp:
        fcntl.flock(held, fcntl.LOCK_EX)  # a run building this cache right now, into its hidden temporary
        Path(tmp).write_bytes(b"x")
        assert main(["cache", "--clear"]) == 0
        assert Path(tmp).is_file()
    cleared = summary_rows(capsys.readouterr().out)
    assert cleared["kept"] == "1 cache(s) another run is building", cleared
    assert cleared["removed"].endswith(" file(s)") and cleared["folder"] == str(tmp_path / "cache"), cleared
    assert list((tmp_path / "cache" / "corpora").iterdir()) == [] and busy.read_bytes() == b"x"  # it finished
    assert len(load_corpus(EXAMPLES / "passages.tsv")) == 6  # parsed again


def test_the_suite_caches_parsed_sources_outside_the_users_home(tmp_path_factory) -> None:
    """The suite parses hundreds of small corpora; they go to its temporary folder, not to ~/.cache/dpr_gc."""
    root = default_cache_dir("corpora")
    assert root.is_relative_to(tmp_path_factory.getbasetemp())
    assert not root.is_relative_to(Path.home() / ".cache")


def test_help_says_where_the_disk_goes(capsys) -> None:
    for command in (["cache", "--help"], ["demo", "--help"]):
        try:
            main(command)
        except SystemExit:
            pass
        text = " ".join(capsys.readouterr().out.split())
        assert "~/.cache/dpr_gc" in text and "DPR_GC_CACHE" in text
    assert "about 270 MB under --output" in text


def test_a_killed_parse_leaves_no_temporary_after_the_next_run(tmp_path: Path) -> None:
    """A parse killed mid-write leaves its hidden temporary (as large as the cache); the next build of the same cache
    deletes it under the cache's lock."""
    from dpr_gc.data.corpus import corpus_cache_path

    cache = corpus_cache_path(EXAMPLES / "passages.tsv", tmp_path)
    cache.parent.mkdir(parents=True, exist_ok=True)
    stale = cache.with_name(f".{cache.name}.k1ll3d.tmp")
    stale.write_bytes(b"half a cache")
    assert len(load_corpus(EXAMPLES / "passages.tsv", tmp_path)) == 6
    assert not stale.exists() and cache.is_file()


def test_clear_deletes_only_the_caches_own_files(tmp_path: Path, monkeypatch, capsys) -> None:
    """--clear removes caches, their locks and temporaries, never a file it did not make; a DPR_GC_CACHE that is a
    file is refused in one line."""
    monkeypatch.setenv("DPR_GC_CACHE", str(tmp_path / "cache"))
    load_corpus(EXAMPLES / "passages.tsv")
    mine = tmp_path / "cache" / "corpora" / "notes.txt"
    mine.write_text("mine")
    assert main(["cache", "--clear"]) == 0
    assert list((tmp_path / "cache" / "corpora").iterdir()) == [mine]
    monkeypatch.setenv("DPR_GC_CACHE", str(mine))
    assert main(["cache"]) == 2
    assert capsys.readouterr().err.startswith(f"error: the cache folder {mine} ($DPR_GC_CACHE")


def test_clear_passes_over_a_users_folder_or_file_named_like_a_lock(tmp_path: Path, capsys) -> None:
    """A user's folder sub.lock in --cache-dir stopped --clear ('sub.lock: Is a directory'), nothing cleared, and a
    user's notes.lock was opened (created if a link's target was missing); only the cache's own lock files are
    opened, the rest are left as they are."""
    cache = tmp_path / "cc"
    load_corpus(EXAMPLES / "passages.tsv", cache)
    (cache / "sub.lock").mkdir()
    (cache / "sub.lock" / "kept.txt").write_text("mine")
    (cache / "notes.lock").write_text("mine")
    (cache / "dangling.lock").symlink_to(tmp_path / "nowhere")
    assert main(["cache", "--clear", "--cache-dir", str(cache)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in cache.iterdir()) == ["dangling.lock", "notes.lock", "sub.lock"]
    assert (cache / "notes.lock").read_text() == "mine" and not (tmp_path / "nowhere").exists()


def test_clear_and_the_listing_cover_every_file_a_training_parse_writes(tmp_path: Path, monkeypatch, capsys) -> None:
    """A training parse writes NAME-HASH.arrow and NAME-HASH.stats.json: --clear left the stats file behind; now it
    removes both (the user's own file stays), and the listing's bytes are those of the cache's files alone."""
    from dpr_gc.data.arrow_cache import cache_usage
    from dpr_gc.data.training import load_dpr_files

    monkeypatch.setenv("DPR_GC_CACHE", str(tmp_path / "cache"))
    load_dpr_files([EXAMPLES / "train.json"])
    train = tmp_path / "cache" / "train"
    written = sorted(p.name for p in train.iterdir())
    assert any(n.endswith(".stats.json") for n in written) and any(n.endswith(".arrow") for n in written), written
    mine = train / "notes.txt"
    mine.write_text("mine, not the cache's" * 100)
    usage = {kind: (n, size) for kind, n, size in cache_usage(tmp_path / "cache")}
    assert usage["train"] == (1, sum(p.stat().st_size for p in train.iterdir() if p != mine))
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p != mine]
    assert main(["cache", "--clear"]) == 0
    assert summary_rows(capsys.readouterr().out)["removed"] == f"{len(cached)} file(s)"
    assert not any(p.exists() for p in cached)
    assert list(train.iterdir()) == [mine]
    assert len(load_dpr_files([EXAMPLES / "train.json"])) > 0  # parsed again


def test_cache_lists_and_clears_a_cache_dir_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    """``cache --cache-dir DIR`` lists and clears the caches a command given ``--cache-dir DIR`` wrote there (corpora
    and training sets together, no kind folders), keeping the user's files and a cache being built; the default
    cache is not touched. A missing DIR, or a file, is refused in one line naming --cache-dir."""
    from dpr_gc.data.training import load_training_data

    monkeypatch.setenv("DPR_GC_CACHE", str(tmp_path / "default"))
    load_corpus(EXAMPLES / "passages.tsv")
    flat = tmp_path / "flat"
    load_corpus(EXAMPLES / "passages.tsv", flat)
    load_training_data([EXAMPLES / "train.json"], flat)
    (flat / "notes.txt").write_text("mine")
    cached = sorted(p for p in flat.iterdir() if p.name != "notes.txt")
    capsys.readouterr()
    assert main(["cache", "--cache-dir", str(flat)]) == 0
    listing = capsys.readouterr().out
    size = f"{sum(p.stat().st_size for p in cached) / 2**20:.1f}"
    assert f"| corpora and train | 2 | {size} | {flat} |" in listing, listing
    busy = flat / "t-0123456789abcdef.arrow"
    with open(str(busy) + ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert main(["cache", "--cache-dir", str(flat), "--clear"]) == 0
    out = summary_rows(capsys.readouterr().out)
    assert (out["removed"], out["folder"], out["kept"][:10]) == (f"{len(cached)} file(s)", str(flat), "1 cache(s)"), out
    assert sorted(p.name for p in flat.iterdir()) == ["notes.txt", busy.name + ".lock"]
    assert len(list((tmp_path / "default" / "corpora").iterdir())) == 2  # its cache and lock
    for given in (tmp_path / "missing", flat / "notes.txt"):
        assert main(["cache", "--cache-dir", str(given)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "--cache-dir" in err[0] and str(given) in err[0], err


@pytest.mark.parametrize("command", ["prepare-data", "train"])
def test_prepare_data_help_says_where_each_cache_goes(capsys, command) -> None:
    """prepare-data's and train's --cache-dir take the training sets' caches and a BEIR folder's corpus alike."""
    try:
        main([command, "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "$DPR_GC_CACHE/corpora" in text and "$DPR_GC_CACHE/train" in text, text


def test_a_tilde_in_the_cache_folder_means_the_home_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    """``~`` in $DPR_GC_CACHE or --cache-dir (quoted, or after ``=``, so the shell left it) is the home folder, as
    in ~/.cache/dpr_gc: no folder named ``~`` is made in the working folder."""
    from dpr_gc.base.guard import default_cache_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPR_GC_CACHE", "~/cy")
    assert default_cache_root()[0] == tmp_path / "home" / "cy"
    load_corpus(EXAMPLES / "passages.tsv")
    assert (tmp_path / "home" / "cy" / "corpora").is_dir()
    assert main(["prepare-data", str(EXAMPLES / "train.json"), "--cache-dir=~/cz"]) == 0
    assert any(p.suffix == ".arrow" for p in (tmp_path / "home" / "cz").iterdir())
    assert main(["cache", "--cache-dir", "~/cz"]) == 0 and f"{tmp_path / 'home' / 'cz'} |" in capsys.readouterr().out
    assert not (tmp_path / "~").exists()
