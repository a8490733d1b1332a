"""Uploading the newest checkpoint to the Hugging Face Hub, in the background, never blocking anything.

Every ``every`` seconds the uploader looks for the newest good checkpoint; when it is newer than the last one
uploaded, it exports it as a Hugging Face model folder and pushes that folder with
``HfApi().upload_folder``. A failed upload is logged and retried with exponential backoff (capped at the
upload interval); it never stops the monitor.

A repository that does not exist yet is created private unless the operator asks for a public one
(``--hub-public``); an existing repository keeps its visibility. The uploaded folder holds the model, the
tokenizer and ``cotrain.json`` (step, run id, the checkpoint's folder name), no path of this machine.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cotrain import checkpoints as ck

logger = logging.getLogger(__name__)

Upload = Callable[[Path, str, str], None]  # (folder, repo id, commit message)


def hf_upload(folder: Path, repo: str, message: str, private: bool = True, api: Any = None) -> None:
    """Push ``folder`` to the Hub model repo ``repo`` (created if missing, ``private`` unless told otherwise;
    needs HF_TOKEN or a login). ``api``: an ``HfApi`` (default: a new one)."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo, exist_ok=True, private=private)
    api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=message)


class HubUploader(threading.Thread):
    def __init__(
        self,
        checkpoints: str | Path,
        repo: str,
        every: float,
        work_dir: str | Path,
        stop: threading.Event,
        upload: Upload | None = None,
        backoff: float = 10.0,
        public: bool = False,
    ) -> None:
        super().__init__(daemon=True, name="hub-upload")
        self.checkpoints, self.repo, self.every = Path(checkpoints), repo, every
        self.folder = Path(work_dir) / "export"
        self.upload: Upload = upload or functools.partial(hf_upload, private=not public)
        self.stop, self.backoff = stop, backoff
        self.uploaded_step = -1

    def run(self) -> None:
        while not self.stop.wait(self.every):
            found = ck.latest_good(self.checkpoints)
            if found is None or found[1]["step"] <= self.uploaded_step:
                continue
            path, meta = found
            self._push(path, meta["step"])

    def _push(self, path: Path, step: int) -> None:
        delay, attempt = self.backoff, 1
        while not self.stop.is_set():
            try:
                ck.export(path, self.folder, local_path=False)
                self.upload(self.folder, self.repo, f"cotrain: global step {step}")
                self.uploaded_step = step
                logger.info(f"Uploaded global step {step} to the Hub repository {self.repo}")
                return
            except Exception as e:  # the network or the Hub: retried, never fatal
                if not path.exists():  # pruned meanwhile: the next interval takes the newer one
                    logger.info(f"Checkpoint {path.name} was pruned before its upload; taking the newer one")
                    return
                logger.warning(
                    f"Upload to {self.repo} failed (attempt {attempt}: {type(e).__name__}: {e}); "
                    f"retrying in {delay:.0f} s"
                )
            if self.stop.wait(delay):
                return
            delay, attempt = min(delay * 2, self.every), attempt + 1
