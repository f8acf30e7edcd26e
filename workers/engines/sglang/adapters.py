"""LoRA adapters on SGLang servers (launched with `--enable-lora`): loaded by name.

A pinned adapter version (`NAME@vN`) is written to a PEFT directory (`workers.engines.adapters.files`),
then loaded on every server under its pinned name with
`POST /load_lora_adapter {"lora_name", "lora_path"}`; a `/generate` call names it in `lora_path`.
Evicted ones are unloaded with `POST /unload_lora_adapter {"lora_name"}` (SGLang 0.5.23,
`srt/managers/io_struct.py`: `LoadLoRAAdapterReqInput`, `UnloadLoRAAdapterReqInput`,
`GenerateReqInput.lora_path`; answers `LoRAUpdateOutput` `{"success", "error_message",
"loaded_adapters"}`, 400 when not a success). The directory is kept after an unload: SGLang
reloads an adapter it unloaded from its path when a request names it again (servers shared by
several workers), and a version's files never change.

A server that lost an adapter (restarted) answers `/generate` 400 "Got LoRA adapter that has never
been loaded" (`tokenizer_manager._resolve_lora_path`): the call is refused, the job handed back,
and the adapter forgotten as resident, so it is loaded again before it runs here next.
"""

# SGLang's `/generate` answer for a `lora_path` it has no record of (never loaded, or lost in a restart).
NEVER_LOADED = "Got LoRA adapter that has never been loaded"
# SGLang's `/load_lora_adapter` answer for a name it already serves (a version's files never change).
ALREADY_LOADED = "already loaded"
