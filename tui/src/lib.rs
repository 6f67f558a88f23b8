//! Terminal views of the observer's model stream.
