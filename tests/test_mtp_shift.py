"""Multi-token prediction's shifts (models/objectives/mtp.py) against the raw windows they come from: each row a
window of T + 1 tokens with each token's document (packed documents, padding at the end of one row, a masked span
of targets), the main batch made as the data pipeline makes it (a target counted where it and its input share a
document and it is not masked); at each depth, each position's read token, predicted token and whether it counts
written out here token by token from the window: the token d ahead, the one after it, counted only inside the window,
inside one document (the input's and the predicted token's) and unmasked. A shift that counts targets across a
document's boundary fails it."""
import numpy as np
import pytest

from models.batch import from_windows
from models.objectives import mtp

T = 12
# each row: its tokens (T + 1) and their documents (0: padding)
DOCS = np.array([[1] * 5 + [2] * 4 + [3] * 4,  # three packed documents
                 [1] * 9 + [0] * 4,  # one document, then padding
                 [1] * 13])  # one document filling the window
MASKED = np.zeros((3, T), bool)
MASKED[2, 3:6] = True  # a masked span of targets (e.g. a prompt's), row 2


def _batch():
    rng = np.random.default_rng(0)
    windows = rng.integers(1, 100, size=(3, T + 1)).astype(np.int32)
    weight = ((DOCS[:, :-1] == DOCS[:, 1:]) & (DOCS[:, :-1] != 0) & ~MASKED).astype(np.float32)
    return windows, from_windows(windows, weight, DOCS[:, :-1])


def _reference(windows, d: int):
    """(read, predicted, counted) (3, T) of depth d, position by position from the window."""
    read, pred, count = (np.zeros((3, T), np.int64) for _ in range(3))
    for r in range(3):
        for t in range(T):
            if t + d <= T:
                read[r, t] = windows[r, t + d]
            if t + d + 1 <= T:
                pred[r, t] = windows[r, t + d + 1]
                doc = DOCS[r, t]
                count[r, t] = doc != 0 and all(DOCS[r, u] == doc for u in range(t, t + d + 2)) and \
                    not MASKED[r, t + d]
    return read, pred, count


@pytest.mark.parametrize("d", [1, 2, 3])
def test_shifts_equal_the_windows_written_out(d):
    windows, batch = _batch()
    got = {k: np.asarray(v) for k, v in mtp.shifted(batch, d).items()}
    read, pred, count = _reference(windows, d)
    np.testing.assert_array_equal(got["loss_weight"], count.astype(np.float32))
    c = count.astype(bool)  # where a target counts, what is read and predicted is the window's
    np.testing.assert_array_equal(got["targets"][c], pred[c])
    np.testing.assert_array_equal(got["tokens"][c], read[c])
    assert count.sum() > 0 and (~c & (DOCS[:, :-1] != 0)).any()  # some counted, some left out


def test_a_shift_that_crosses_documents_fails_the_reference():
    """The same shift without the document check counts targets across a boundary: the reference sees it."""
    windows, batch = _batch()
    wrong = np.asarray(mtp.shifted({**batch, "segment_ids": np.ones_like(batch["segment_ids"])}, 2)["loss_weight"])
    assert not np.array_equal(wrong, _reference(windows, 2)[2].astype(np.float32))
