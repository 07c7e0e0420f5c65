"""Agent-framework integrations: `tokenspeed.integrations.langchain.ChatTokenSpeed` (LangChain)."""
