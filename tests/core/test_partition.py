"""piece_bounds (hypothesis properties) and ArrayOps' zero-copy views."""

import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched.backends import ArrayOps
from commsched.partition import piece_bounds

pytestmark = pytest.mark.timeout(60)


@settings(max_examples=300, deadline=None)
@given(numel=st.integers(0, 5000), element_size=st.sampled_from([1, 2, 4, 8, 16]),
       partition_bytes=st.integers(1, 4096))
def test_pieces_cover_the_tensor_exactly_contiguously_and_within_the_partition_size(
        numel, element_size, partition_bytes):
    bounds = piece_bounds(numel, element_size, partition_bytes)
    if numel == 0:
        assert bounds == []
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False):
        assert stop == start  # contiguous, ordered, disjoint
    for start, stop in bounds:
        assert stop - start >= 1
        assert (stop - start) * element_size <= partition_bytes or stop - start == 1
    # as few pieces as the size allows: every piece but the last is full
    per_piece = max(1, partition_bytes // element_size)
    assert all(stop - start == per_piece for start, stop in bounds[:-1])


def test_an_element_larger_than_the_partition_goes_alone():
    assert piece_bounds(3, 8, 5) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("args", [(-1, 4, 16), (4, 0, 16), (4, 4, 0), (4, 4, -8)])
def test_invalid_arguments_raise_value_error(args):
    with pytest.raises(ValueError, match="piece_bounds"):
        piece_bounds(*args)


@settings(max_examples=50, deadline=None)
@given(numel=st.integers(1, 200), typecode=st.sampled_from("hifd"), partition_bytes=st.integers(1, 64))
def test_views_are_zero_copy_so_writing_a_view_writes_the_tensor(numel, typecode, partition_bytes):
    ops = ArrayOps()
    tensor = array.array(typecode, [0] * numel)
    for index, (start, stop) in enumerate(piece_bounds(ops.numel(tensor), ops.element_size(tensor), partition_bytes)):
        view = ops.flat_view(tensor, start, stop)
        assert len(view) == stop - start
        for i in range(len(view)):
            view[i] = index + 1
    expected = []
    for index, (start, stop) in enumerate(piece_bounds(numel, tensor.itemsize, partition_bytes)):
        expected += [index + 1] * (stop - start)
    assert list(tensor) == expected
