"""Models from the Hugging Face Hub, through `huggingface_hub` and its cache (the layout that
vLLM, transformers and `hf download` share, so their downloads are found and reused):

- `names`: a repo id with an optional revision (`Org/Name@REVISION`);
- `files`: which of a repo's files the engine reads, and its weights' format from config.json;
- `cache`: finding a repo's snapshot in the cache, offline, and listing the cached models;
- `pull`: downloading a repo's engine files into the cache (resumed, checked against the hub's
  checksums).

No torch here: `wd-engine pull` stays quick to start.
"""
