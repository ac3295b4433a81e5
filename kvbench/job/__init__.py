"""One job, from composed config to stored records; imports the engine, never report or tools (ARCHITECTURE.md)."""
