"""The engine's HTTP face: SGLang's native protocol (`sglang_api`, its `sampling_params` in
`sampling_api`, its error envelopes in `protocol_errors`), the OpenAI-compatible routes
(`openai_api`) and the aiohttp app and `verst serve` (`app`)."""
