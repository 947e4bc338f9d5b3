from streamchat.bench.display_overhead import measure_display_overhead
from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer


def test_both_sides_generate_the_same_reply_and_report_speeds():
    result = measure_display_overhead(
        tiny_model("llama", vocab_size=700), byte_level_tokenizer(), trials=2, max_new_tokens=6, sinks=4, window=40
    )
    assert len(result.engine_tokens_per_second) == len(result.app_tokens_per_second) == 2
    assert all(speed > 0 for speed in result.engine_tokens_per_second + result.app_tokens_per_second)
    assert result.ratio > 0
