"""Helpers for the scripts that start vLLM engines offline (tests, the demo, benchmarks)."""

from __future__ import annotations


def shutdown_engine(llm) -> None:
    """Stops an ``LLM``'s engine and joins vLLM's output thread while the interpreter is still fully alive.

    Left to itself, vLLM stops the engine from a finalizer at interpreter exit and does not wait for its
    daemon thread ``EngineCoreOutputQueueThread``. If that thread frees its last outputs (which hold
    tensors) after the interpreter has started finalizing, torch's dealloc re-takes the GIL, CPython ends
    the thread with ``pthread_exit``, and the unwind through a noexcept C++ frame calls std::terminate:
    the process aborts (rc -6, "terminate called without an active exception") although its output was
    complete. A race at process exit, not specific to any model or quantization; joining the thread here
    removes it. Also frees the engine's memory before another engine starts in the same process.
    """
    client = llm.llm_engine.engine_core
    client.shutdown()
    thread = getattr(client, "output_queue_thread", None)
    if thread is not None:
        thread.join(timeout=60)
