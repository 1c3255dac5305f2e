"""Model shapes the tests write random EXL2 directories at (format/random_model.write_random_exl2_model)."""

# Two layers of a narrow Llama with grouped-query attention: seconds to write and load on the CPU.
SMALL = {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000}
