"""Tool calling for /v1/chat/completions: tools into the prompt, tool_choice into a grammar, calls out of
the text (parsers for the Hermes/Qwen and Llama 3.1 JSON formats) and into OpenAI's response shapes."""
