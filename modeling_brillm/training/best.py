"""Keep the best model by held-out loss, as `Trainer(load_best_model_at_end=True)` does: its weights in BEST_FILE and in
every checkpoint (a resumed run knows the same best), back in the model before the final save. Step 0 never counts."""

import math
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from .checkpoints import BEST_FILE, RESUME, TMP_PREFIX, writing
from .fsdp import full_state_dict, reshard


class BestModel:
    """The best evaluation so far (`step`, `eval_loss`) and its weights on disk. `enabled=False`: a no-op."""

    def __init__(self, output_dir, accelerator, enabled: bool = True):
        self.path = Path(output_dir) / BEST_FILE
        self.tmp = self.path.with_name(TMP_PREFIX + BEST_FILE)  # written, then renamed: never a half-written best
        self.accelerator, self.enabled = accelerator, enabled
        self.step, self.eval_loss = None, math.inf

    def state(self) -> dict | None:
        """What a checkpoint's train state records (None before the first evaluation)."""
        return None if self.step is None else {"step": self.step, "eval_loss": self.eval_loss}

    def update(self, model, step: int, eval_loss: float) -> bool:
        """Record an evaluation; write the weights when it is the best so far (on every process: gathering a sharded
        model's weights is collective). True when this step became the best."""
        if not self.enabled or not eval_loss < self.eval_loss:  # NaN never wins
            return False
        gather = getattr(model, "full_state_dict", None)  # a source-sharded model gathers its own table
        state_dict = gather() if gather is not None else full_state_dict(self.accelerator, model)
        if self.accelerator.is_main_process:
            tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            with writing(self.path.parent, "the best model", "the checkpoints are intact; " + RESUME, need,
                         cleanup=lambda: self.tmp.unlink(missing_ok=True)):
                save_file(tensors, str(self.tmp), metadata={"step": str(step), "eval_loss": repr(eval_loss)})
            os.replace(self.tmp, self.path)
        self.accelerator.wait_for_everyone()
        self.step, self.eval_loss = step, eval_loss
        return True

    def write_into(self, folder):
        """Put the best weights into a checkpoint folder (main process; a hard link, else a copy)."""
        if self.enabled and self.step is not None and self.accelerator.is_main_process:
            try:
                os.link(self.path, Path(folder) / BEST_FILE)
            except OSError:
                shutil.copyfile(self.path, Path(folder) / BEST_FILE)

    def restore(self, state: dict | None, checkpoint):
        """Resume: the best step and loss from the checkpoint's train state, its weights file back in place."""
        if not self.enabled or not state:
            return
        source = Path(checkpoint) / BEST_FILE
        if self.accelerator.is_main_process and source.is_file():
            shutil.copyfile(source, self.tmp)
            os.replace(self.tmp, self.path)
        self.accelerator.wait_for_everyone()
        self.step, self.eval_loss = int(state["step"]), float(state["eval_loss"])

    def load_into(self, unwrapped, prepared=None):
        """Put the best weights back into the model (on every process; `prepared`: the FSDP-wrapped model)."""
        if prepared is not None:  # FSDP: the main process reads, torch broadcasts into every shard
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            reshard(prepared)  # the last evaluation left the weights gathered
            full = load_file(str(self.path)) if self.accelerator.is_main_process else {}
            set_model_state_dict(prepared, full, options=StateDictOptions(full_state_dict=True,
                                                                          broadcast_from_rank0=True))
        elif hasattr(unwrapped, "load_full_state_dict"):  # source-sharded: each process reads its own rows
            unwrapped.load_full_state_dict(self.path)
        else:
            unwrapped.load_state_dict(load_file(str(self.path), device=str(next(unwrapped.parameters()).device)))
        self.accelerator.wait_for_everyone()

    def discard(self):
        """Remove the working file once the final folder holds the kept model."""
        if self.accelerator.is_main_process:
            self.path.unlink(missing_ok=True)
