"""The torch reference engine: a Llama-style decoder on real tensors that re-shards a live model.

Public API (see each module):

    TorchEngine(model_dir, layout, device="cpu", *, backend="auto", num_kv_blocks=256, block_size=16,
                max_tokens_per_step=256, expected_sha256=None, timeout_s=120.0, length_buckets=None)
      .add_request(seq_id, prompt_ids, max_new_tokens, sampling=None, priority=0)
      .step() -> list[StepOutput(seq_id, token_id, finished)]
      .export_kv(seq_id, *, include_kv=True) -> KVState
      .import_kv(seq_id, state)
      .replay(seq_id, prompt_ids, generated_ids, max_new_tokens, sampling=None, priority=0)
      .pause(seq_id) / .resume(seq_id)      # hold a sequence still while its KV is in flight
      .drop(seq_id) -> bool
      .shutdown()
    Layout / StageSpec (layout.py), SamplingParams (sampling.py), KVState (kvstate.py)
    batching: which tokens each step feeds - priority classes, length buckets, preemption
    kvtransfer: encode_kv_state / decode_kv_state, KVReceiver, send_kv_states
    switch: switch_sequences(old, new, seq_ids, path="migrate"|"replay", link=...)

Worker processes (one per stage and TP rank) are started by TorchEngine and stopped by
shutdown(); the agent daemon owns one engine per plan it runs, drives it from one thread, and
runs every command (export, import, pause, drop) between two steps — the safe boundary.

Moving a sequence S from agent A to agent B (KV never passes the controller):
  B: KVReceiver(expect_model_sha256=sha) listening; its engine thread imports what get() returns.
  A: state = engine.export_kv(S); engine.pause(S); send_kv_states(B_addr, [state])  (acked when
     the frame arrived intact). Replay path: export_kv(S, include_kv=False) — the same frame
     without KV; import_kv on B re-prefills it.
  B: engine.import_kv(S, state) -> reports "S imported" (or the error) to the controller.
  A: engine.drop(S) on "imported", engine.resume(S) on failure (rollback).
"""
