"""A step's rows as the model runner lays them out: the tokens a chunk computes and the decode rows' slot table."""

from __future__ import annotations

import torch

from radixserve.runtime.batch import ScheduledChunk
from radixserve.runtime.request import Req
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.step_layout import StepRow, lay_out


def test_a_chunks_tokens_are_its_slice_of_prompt_and_output() -> None:
    req = Req("r", [10, 11, 12, 13], SamplingParams())
    req.output_ids = [20, 21, 22]
    everything = req.all_ids
    for start in range(len(everything) + 1):
        for end in range(start, len(everything) + 1):
            assert req.ids(start, end) == everything[start:end], (start, end)
    assert ScheduledChunk(req, 5, 6, sample=True).tokens == [21]
    assert ScheduledChunk(req, 2, 5, sample=True, draft=(7, 8)).tokens == [12, 13, 20, 7, 8]


def test_decode_rows_of_different_lengths_are_padded_into_one_table() -> None:
    tables = [[5, 6, 7], [9], [1, 2, 3, 4, 8]]
    rows = [StepRow([100 + i], len(t) - 1, t, True) for i, t in enumerate(tables)]
    rows.append(StepRow([1, 2], 0, [30, 31], False))  # an extend after the decodes
    input_ids, positions, meta = lay_out(rows, torch.device("cpu"))
    assert input_ids.tolist() == [100, 101, 102, 1, 2]
    assert positions.tolist() == [2, 0, 4, 0, 1]
    assert meta.num_decode == 3
    assert meta.decode_slots.dtype == torch.long
    assert meta.decode_slots.tolist() == [[5, 6, 7, 5, 5], [9, 5, 5, 5, 5], [1, 2, 3, 4, 8]]
    assert meta.decode_lens.tolist() == [3, 1, 5]
    assert meta.out_slots.tolist() == [7, 9, 8, 30, 31]
    # The model runner hands a request's own slot list in: the step's tensors must not follow its later changes.
    tables[0].append(40)
    tables[2][0] = 41
    assert meta.decode_slots.tolist() == [[5, 6, 7, 5, 5], [9, 5, 5, 5, 5], [1, 2, 3, 4, 8]]
