"""Model code (the Llama family), its configuration and weight loading."""
