"""Degeneracy measures of regenerated text: repeated n-grams and budget hits."""
import pytest

from actwave.capture.quality import degeneracy, repeated_ngram_share, reply_texts


def test_repeated_ngram_share_counts_earlier_occurrences():
    assert repeated_ngram_share(list(range(20))) == 0.0
    loop = [1, 2, 3, 4, 5] * 20  # 97 4-grams, only the first 5 are new
    assert repeated_ngram_share(loop) == pytest.approx(92 / 97)
    assert repeated_ngram_share([1, 2, 3]) == 0.0  # no 4-gram at all
    assert repeated_ngram_share([7, 7, 7], n=1) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="n must be >= 1"):
        repeated_ngram_share([1], n=0)


def test_degeneracy_summary_and_replies():
    replies = [list(range(10)), [1, 2, 3, 4] * 4, list(range(3))]
    summary = degeneracy(replies, max_new_tokens=11)
    assert summary["replies"] == 3 and summary["budget_hit_share"] == pytest.approx(2 / 3)
    assert summary["median_repeated_4gram"] == 0.0
    assert summary["mean_repeated_4gram"] == pytest.approx((9 / 13) / 3)
    conversations = [{"messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "a"}]}]
    assert reply_texts(conversations) == ["a"]
    with pytest.raises(ValueError, match="no replies"):
        degeneracy([], 5)


def test_pinned_pool_reads_verified_and_old_pins_only_when_asked(tmp_path):
    """The committed eval pool reads back verified; a chunk without a sha256 in its manifest
    (a pin from before checksums) is refused unless read unverified."""
    import json
    import shutil

    from actwave.capture.quality import pinned_conversations
    from actwave.config import repo_root
    from actwave.integrity import IntegrityError

    pinned = sorted((repo_root() / "results" / "regenerated").glob("smollm2-135m-eval-*"))[0]
    manifest, conversations = pinned_conversations(pinned)
    assert len(conversations) == manifest["n_conversations"] == 400
    old = shutil.copytree(pinned, tmp_path / pinned.name)
    stripped = json.loads((old / "manifest.json").read_text())
    for chunk in stripped["chunks"]:
        del chunk["sha256"]
    (old / "manifest.json").write_text(json.dumps(stripped))
    with pytest.raises(IntegrityError, match="a sha256"):
        pinned_conversations(old)
    assert pinned_conversations(old, verified=False)[1] == conversations
