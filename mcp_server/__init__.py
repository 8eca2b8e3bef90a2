"""The MCP server on /mcp (docs/mcp.md): the 2026-07-28 stateless wire with the
io.modelcontextprotocol/tasks extension, and the 2025-11-25 surface for older hosts."""
