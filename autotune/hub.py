"""``--model meta-llama/Llama-3.1-8B``: a Hugging Face model id, read as its ``config.json`` alone.

The tuner builds every model from its config (random weights, the same shapes),
so the one file is all it needs: taken from the local Hugging Face cache
when the model was used on this host (``HF_HOME``, ``HF_HUB_CACHE``), else
downloaded, unless ``HF_HUB_OFFLINE`` is set. Weights are never downloaded.
"""

from __future__ import annotations

import re

from autotune.errors import UsageError

# owner/name, as the hub spells repository ids (no path-like forms: "./x", "/x", "a/b/c").
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and not value.endswith(".json") and ".." not in value


def hub_config_path(model_id: str, revision: str | None = None) -> str:
    """The local path of ``model_id``'s config.json: from the cache, else downloaded (that file only)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError, GatedRepoError, HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled,
        HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError,
    )  # fmt: skip

    fix = "log in (hf auth login) or give the path of its config.json: --model path/to/config.json"
    try:
        return hf_hub_download(model_id, "config.json", revision=revision)
    except GatedRepoError:
        raise UsageError(f"--model {model_id}: a gated model on the Hugging Face hub, and this host has no access; "
                         f"accept its licence on the hub and {fix}") from None
    except RepositoryNotFoundError:
        raise UsageError(f"--model {model_id}: no such model on the Hugging Face hub (or a private one); check the id, "
                         f"or {fix}") from None
    except RevisionNotFoundError:
        raise UsageError(f"--model {model_id}: no such revision on the Hugging Face hub") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        # Offline (HF_HUB_OFFLINE, or no network) and not in the cache.
        raise UsageError(f"--model {model_id}: its config.json is not in the Hugging Face cache and the hub cannot be "
                         f"reached; run once where it can, or give the path of its config.json") from None
    except EntryNotFoundError:
        raise UsageError(f"--model {model_id}: the hub repository has no config.json (not a transformers model?); "
                         "give the path of one") from None
    except HFValidationError as exc:
        raise UsageError(f"--model {model_id}: not a Hugging Face model id ({exc})") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "no response"
        raise UsageError(f"--model {model_id}: the Hugging Face hub answered {status}; {fix}") from None
