"""What the tests share, written once: processes and waiting (`processes`), tiny models (`models`),
stand-in servers (`sglang_standin`, `standin_generator`), real servers (`vllm_env`, `vllm_server`,
`sentinel_group`), references the tests compare against (`sampling_reference`, `invariants`), and
the fixtures' extras (`reward_functions`, `weights_trainer`, `sglang_wheel`)."""
