"""The torch reference engine: a Llama-style decoder on real tensors that re-shards a live model.

Public API (see each module):

    TorchEngine(model_dir, layout, device="cpu", *, backend="auto", num_kv_blocks=256, block_size=16,
                max_tokens_per_step=256, expected_sha256=None, timeout_s=120.0)
      .add_request(seq_id, prompt_ids, max_new_tokens, sampling=None)
      .step() -> list[StepOutput(seq_id, token_id, finished)]
      .export_kv(seq_id, *, include_kv=True) -> KVState
      .import_kv(seq_id, state)
      .replay(seq_id, prompt_ids, generated_ids, max_new_tokens, sampling=None)
      .drop(seq_id) -> bool
      .shutdown()
    Layout / StageSpec (layout.py), SamplingParams (sampling.py)
    kvtransfer: encode_kv_state / decode_kv_state, KVReceiver, send_kv_states
    switch: switch_sequences(old, new, seq_ids, path="migrate"|"replay", link=...)

Worker processes (one per stage and TP rank) are started by TorchEngine and stopped by
shutdown(); the agent daemon owns one engine per plan it runs.
"""
