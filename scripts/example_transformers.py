"""A real client: a Hugging Face transformers model generating with kvattn as its attention function.

    PYTHONPATH=. python3 scripts/example_transformers.py [--new-tokens 48] [--batch 2] [--prompt 200]

A small randomly initialised Llama-style model (GQA 8/2 heads, head_dim 128, bf16) generates greedily on PyTorch's
default stream, once with transformers' SDPA attention and once with kvattn registered through transformers'
attention-function interface. With kvattn, the prompt goes through the ragged prefill wrapper and every decode step
through the paged decode wrapper, reading a paged KV cache that this script keeps (pages scattered at random);
transformers' own cache only hands over each step's new keys and values, which the script writes into its pages.
Plain PyTorch usage: torch tensors in, no stream argument, `torch.from_dlpack` on the output.

The kvattn model generates twice: free-running, and teacher-forced on SDPA's tokens (a logits processor picks
SDPA's token, the raw logits are kept), so every step compares the two attentions on the same inputs. Prints the
token agreement and the largest logit difference against SDPA; exits 1 on a disagreement beyond bf16 noise (a
teacher-forced step whose greedy token differs where SDPA's top-two margin is larger than twice the largest logit
difference, or logits off by more than 5% of their range), 0 otherwise; skips (exit 0, with a message) where
torch, transformers or a GPU is missing.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
PAGE = 16


class PagedKV:
    """The script's own paged KV cache: per layer K and V [num_pages, PAGE, Hkv, D]; each request's pages are a
    random subset of the pool (scattered); kvattn's plans for the current step, shared by every layer."""

    def __init__(self, torch, kvattn, layers, batch, max_len, hkv, d, hq, rng):
        self.torch, self.kvattn = torch, kvattn
        pages_per_req = -(-max_len // PAGE)
        num_pages = batch * pages_per_req + 7
        perm = rng.permutation(num_pages)[:batch * pages_per_req].astype(np.int32)
        self.pages = perm.reshape(batch, pages_per_req)             # [batch, pages per request]
        self.k = [torch.empty((num_pages, PAGE, hkv, d), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        self.v = [torch.empty_like(x) for x in self.k]
        self.batch, self.hq, self.hkv, self.d = batch, hq, hkv, d
        self.len = 0
        self.prefill = kvattn.BatchPrefillWithRaggedKVCache()
        self.decode = kvattn.BatchDecodeWithPagedKVCache()

    def _write(self, layer, k_new, v_new, start, n):
        """Write n new tokens per request (positions start..start+n-1); k_new / v_new [batch, Hkv, n, D]."""
        torch = self.torch
        pos = np.arange(start, start + n)
        page = torch.from_numpy(self.pages[:, pos // PAGE].reshape(-1).astype(np.int64)).cuda()
        slot = torch.from_numpy(np.tile(pos % PAGE, self.batch).astype(np.int64)).cuda()
        self.k[layer][page, slot] = k_new.transpose(1, 2).reshape(-1, self.hkv, self.d)
        self.v[layer][page, slot] = v_new.transpose(1, 2).reshape(-1, self.hkv, self.d)

    def plan_step(self, n_new, scaling):
        """Once per forward pass (at layer 0): n_new tokens per request are added."""
        if n_new > 1:   # the prompt: ragged prefill over the new tokens themselves
            if self.len != 0:
                raise ValueError("this example prefills once, then decodes one token at a time")
            indptr = np.arange(0, (self.batch + 1) * n_new, n_new, dtype=np.int32)
            self.prefill.plan(indptr, indptr, self.hq, self.hkv, self.d, causal=True, sm_scale=scaling)
        else:
            lens = np.full(self.batch, self.len + 1)
            npg = -(-lens // PAGE)
            pt = self.kvattn.PageTable(np.concatenate([[0], np.cumsum(npg)]).astype(np.int32),
                                       np.concatenate([self.pages[i, :npg[i]] for i in range(self.batch)]),
                                       (lens - (npg - 1) * PAGE).astype(np.int32), PAGE)
            self.decode.plan(pt, self.hq, self.hkv, self.d, sm_scale=scaling)

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        """transformers' attention-function signature: query [B, Hq, S, D], key / value [B, Hkv, T, D] (T: every
        token so far, from transformers' cache); returns ([B, S, Hq, D], None)."""
        torch = self.torch
        layer = module.layer_idx
        b, hq, s, d = query.shape
        if layer == 0:
            self.plan_step(s, scaling)
        start = key.shape[2] - s
        self._write(layer, key[:, :, start:], value[:, :, start:], start, s)
        if s > 1:
            q = query.transpose(1, 2).reshape(b * s, hq, d)
            k = key[:, :, start:].transpose(1, 2).reshape(b * s, self.hkv, d)
            v = value[:, :, start:].transpose(1, 2).reshape(b * s, self.hkv, d)
            o = self.prefill.run(q, k, v)
        else:
            o = self.decode.run(query[:, :, 0], self.k[layer], self.v[layer])
        if layer == module.config.num_hidden_layers - 1:
            self.len = start + s
        return torch.from_dlpack(o).view(b, s, hq, d), None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    try:
        import torch
        import transformers
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        print(f"example_transformers skipped: {exc}")
        return 0
    import kvattn
    if not (torch.cuda.is_available() and kvattn.gpu_available()):
        print("example_transformers skipped: no CUDA GPU found")
        return 0
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                      initializer_range=0.05, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device="cuda")
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
               pad_token_id=0, eos_token_id=None)
    from transformers import LogitsProcessor, LogitsProcessorList

    class FollowTokens(LogitsProcessor):
        """Teacher forcing inside generate(): the next token is SDPA's, whatever these logits say (the raw logits
        are kept by output_logits), so every step compares the two attentions on the same inputs."""

        def __init__(self, tokens):
            self.tokens, self.step = tokens, 0

        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, -float("inf"))
            forced[torch.arange(scores.shape[0]), self.tokens[:, self.step]] = 0
            self.step += 1
            return forced

    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        tok_ref = ref.sequences[:, args.prompt:]
        cache = PagedKV(torch, kvattn, args.layers, args.batch, args.prompt + args.new_tokens + 1,
                        cfg.num_key_value_heads, 128, cfg.num_attention_heads, rng)
        AttentionInterface.register("kvattn", cache.attention)
        try:
            from transformers import AttentionMaskInterface
            from transformers.masking_utils import sdpa_mask
            AttentionMaskInterface.register("kvattn", sdpa_mask)   # the mask is not used: prompts are unpadded
        except ImportError:
            pass
        model.set_attn_implementation("kvattn")
        free = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)       # free-running
        cache.len = 0
        forced = model.generate(ids, attention_mask=torch.ones_like(ids),
                                logits_processor=LogitsProcessorList([FollowTokens(tok_ref)]), **gen)
    torch.cuda.synchronize()
    tok_ref = tok_ref.cpu().numpy()
    assert (forced.sequences[:, args.prompt:].cpu().numpy() == tok_ref).all()
    lr = torch.stack(ref.logits, 1).float().cpu().numpy()     # [batch, steps, vocab], SDPA
    lk = torch.stack(forced.logits, 1).float().cpu().numpy()  # kvattn on the same inputs
    max_diff = float(np.abs(lk - lr).max())
    scale = float(np.abs(lr).max())
    agree = lk.argmax(-1) == tok_ref
    top2 = np.sort(lr, -1)[..., -2:]
    margin = top2[..., 1] - top2[..., 0]
    near_tie = margin <= 2 * max_diff
    ok = max_diff <= 0.05 * scale and bool((agree | near_tie).all())
    free_agree = free.sequences[:, args.prompt:].cpu().numpy() == tok_ref
    first = [int(np.argmin(a)) if not a.all() else a.size for a in free_agree]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, kvattn {kvattn.__version__}, "
          f"GPU {kvattn._driver.device_name()}")
    print(f"model: Llama-style, {args.layers} layers, hidden 1024, heads 8 q / 2 kv, head_dim 128, bf16, random init; "
          f"batch {args.batch}, prompt {args.prompt}, {args.new_tokens} greedy tokens; kvattn: ragged prefill + paged "
          f"decode (page {PAGE}, scattered pages), PyTorch's default stream, no stream argument")
    print(f"free-running: tokens equal to SDPA's up to step {first} of {args.new_tokens} (random weights: ties of "
          f"near-equal logits decide where they part)")
    print(f"on SDPA's tokens (teacher-forced, every step through kvattn): greedy token agreement "
          f"{int(agree.sum())}/{agree.size} ({agree.mean():.1%}); the {int((~agree).sum())} others are near ties "
          f"(SDPA's top-two margin <= 2 x the largest logit difference): {bool((agree | near_tie).all())}; largest "
          f"logit difference {max_diff:.4f} (logits span +-{scale:.2f}, bound 5%: {0.05 * scale:.2f}); "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
