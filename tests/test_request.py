"""Request bookkeeping."""

from pypto_serving.request import Request
from pypto_serving.sampling import SamplingParams


def test_request_tokens_slices_prompt_and_output():
    req = Request("r", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5])
    for start in range(6):
        for end in range(start, 6):
            assert req.tokens(start, end) == req.token_ids[start:end]
