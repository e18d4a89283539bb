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
