"""The recipe's entry point recording what every MoE router of the model did in each training step, to MOE_LOG as
one JSON line per step: the tokens each expert kept per micro batch (a forward hook on the router's routing map,
after token dropping), the micro batch's token count, and the router's expert bias before and after the step."""

from __future__ import annotations

import json
import os

from megatron.core.transformer.moe.router import TopKRouter

from megatron_ext.training import trainer
from recipes.pretrain import entry_point


def _recording(train_step):
    def train_step_recording(self, data_iterator):
        routers = [m for chunk in self.model for m in chunk.modules() if isinstance(m, TopKRouter)]
        kept: list[list[list[float]]] = [[] for _ in routers]
        tokens: list[list[int]] = [[] for _ in routers]

        def hook(index: int):
            def record(_module, _inputs, output):
                _, routing_map = output
                kept[index].append(routing_map.sum(dim=0).tolist())
                tokens[index].append(routing_map.shape[0])
            return record

        before = [r.expert_bias.detach().clone().tolist() for r in routers]
        handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
        try:
            result = train_step(self, data_iterator)
        finally:
            for handle in handles:
                handle.remove()
        with open(os.environ["MOE_LOG"], "a") as log:
            log.write(json.dumps({"iteration": self.iteration + 1, "kept": kept, "tokens": tokens, "bias_before": before,
                                  "bias_after": [r.expert_bias.detach().tolist() for r in routers]}) + "\n")
        return result

    return train_step_recording


if __name__ == "__main__":  # guard required: dist_checkpointing's async save spawns processes
    trainer.Trainer.train_step = _recording(trainer.Trainer.train_step)
    entry_point()
