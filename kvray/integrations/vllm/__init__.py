"""vLLM: a KV connector over kvray's push, its test models (`model`) and prompts (`prompts`).

Nothing here imports vLLM: the submodules that need it do, so this package imports without the
`vllm` extra installed."""
