"""Sample text from a checkpoint: ``python -m recipes.generate --checkpoint DIR --prompt TEXT``.

Reads the latest checkpoint under DIR (saved under any TP/PP/CP layout, trained or imported; local, or in object
storage as ``msc://PROFILE/prefix`` or ``s3://...`` with ``--msc-config``), rebuilds the model in this one process,
encodes the prompt with the run's own tokenizer (``data.tokenizer_model`` of the saved config, or ``--tokenizer``)
and writes a continuation: greedy by default, or sampled with ``--temperature``, ``--top-k`` and
``--top-p``. On the CPU, in one process: a look at what the model writes, not a server.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Optional

from megatron_ext.errors import ConversionError, RecipeError, TokenizerError
from megatron_ext.model.generation import Sampling, generate
from megatron_ext.storage import files
from recipes.saved_model import build_model, layout_config, load_weights, model_parallel_world, read_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipes.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint root (has the tracker file): local, or msc://PROFILE/prefix with --msc-config")
    parser.add_argument("--msc-config", help="multi-storage-client's configuration (the run's storage.msc_config), "
                                             "for a checkpoint in object storage")
    parser.add_argument("--prompt", action="append", required=True, help="text to continue; repeat for several")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = all")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold; 1 = off")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed writes the same text)")
    parser.add_argument("--tokenizer", help="tokenizer to use instead of the saved config's data.tokenizer_model")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    try:
        from megatron_ext.data.tokenizer import load_tokenizer

        files.enable_named(args.checkpoint, args.msc_config)
        saved = read_checkpoint(files.at(args.checkpoint))
        cfg = layout_config(saved)
        path = args.tokenizer or cfg.data.tokenizer_model
        if not path or not Path(path).exists():
            raise TokenizerError(f"the checkpoint's data.tokenizer_model={path!r} does not exist here: pass "
                                 "--tokenizer PATH (a sentencepiece .model or a Hugging Face tokenizer directory)")
        # a prompt starts a sequence: with the tokenizer's BOS, as transformers' generate gets it
        tokenizer = load_tokenizer(path, None if args.tokenizer else cfg.data.tokenizer_type,
                                   include_special_tokens=True)
        if tokenizer.vocab_size > saved.padded_vocab:
            raise ConversionError(f"{path} has {tokenizer.vocab_size} tokens, more than the checkpoint's "
                                  f"{saved.padded_vocab} embedding rows: not this model's tokenizer")
        with model_parallel_world(cfg):
            model = build_model(cfg, saved.vocab_size, initialize=False)
            load_weights(model, saved)
            print(f"{saved.iteration_dir}: {cfg.recipe.name}, {sampling}", file=sys.stderr)
            for prompt in args.prompt:
                ids = generate(model, tokenizer.tokenize(prompt), args.max_new_tokens, saved.vocab_size,
                               cfg.model.seq_length, sampling, stop_token=tokenizer.eod, seed=args.seed)
                print(f"--- {prompt!r}\n{prompt}{tokenizer.detokenize(ids)}", flush=True)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
