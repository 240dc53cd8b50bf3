import math

import pytest

from meshspeed.data import stdlib_corpus, unigram_entropy


def test_corpus_is_deterministic_and_truncated():
    a = stdlib_corpus(max_bytes=200_000)
    assert len(a) == 200_000
    assert a == stdlib_corpus(max_bytes=200_000)
    assert stdlib_corpus(max_bytes=1000) == a[:1000]
    assert b"def " in a and b"import " in a


def test_corpus_skips_tests_and_site_packages():
    from pathlib import Path

    from meshspeed.data import corpus

    root = Path(corpus.sysconfig.get_paths()["stdlib"])
    rels = [p.relative_to(root).as_posix() for p in corpus._stdlib_sources(root)]
    assert rels == sorted(rels)
    assert not any(r.startswith(("test/", "site-packages/")) for r in rels)
    assert not any("/tests/" in r or "/idle_test/" in r or "/test/" in r for r in rels)
    assert "os.py" in rels


def test_unigram_entropy():
    assert unigram_entropy(b"aaaa") == 0.0
    assert unigram_entropy(b"ab" * 10) == pytest.approx(math.log(2))
    assert unigram_entropy(bytes(range(256))) == pytest.approx(math.log(256))
    text = stdlib_corpus(max_bytes=100_000)
    assert 2.5 < unigram_entropy(text) < math.log(256)
    with pytest.raises(ValueError):
        unigram_entropy(b"")
