"""The translation every API shares: a request in Tandem's own form (`request`), bodies that
accept fields the server does not know (`fields`), a job to engine requests (`prepare`), tool
plans and parsers (`tools`), an answer read as text and tool-call blocks (`output`)."""
