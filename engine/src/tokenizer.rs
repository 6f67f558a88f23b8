//! Byte-level BPE tokenizer built from a GGUF vocabulary (`tokenizer.ggml.model = "gpt2"`).
//!
//! # What the GGUF holds (the keys llama.cpp reads)
//! - `tokenizer.ggml.tokens`: token texts, in GPT-2's byte-to-unicode alphabet (byte 0x20 is
//!   `Ġ`, 0x0A is `Ċ`, …), id = index;
//! - `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
//!   6 byte;
//! - `tokenizer.ggml.merges`: `"left right"` pairs, highest priority first;
//! - `tokenizer.ggml.pre`: the pre-tokenizer (`qwen2` supported: the regex below);
//! - `tokenizer.ggml.{bos,eos,padding}_token_id`, `tokenizer.ggml.add_bos_token`.
//!
//! Encoding: control and user-defined tokens are split out of the text first (like llama.cpp
//! with `parse_special = true` and Hugging Face's added tokens), the rest is split by the
//! pre-tokenizer regex, mapped to the byte alphabet and merged by rank (the `tokenizers`
//! crate's BPE). Decoding maps a token's text back through the byte alphabet; control tokens
//! render as their text, unused tokens as nothing.

use std::collections::HashMap;

use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer as HfTokenizer};

use crate::gguf::{Gguf, GgufError};

/// The `qwen2` pre-tokenizer regex (Qwen2/Qwen3's tokenizer.json, with the case-insensitive
/// group spelled out as llama.cpp does).
pub const QWEN2_PRE_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_UNKNOWN: i32 = 2;
pub const TOKEN_CONTROL: i32 = 3;
pub const TOKEN_USER_DEFINED: i32 = 4;
pub const TOKEN_UNUSED: i32 = 5;
pub const TOKEN_BYTE: i32 = 6;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: tokenizer: {what}")]
    Bad { path: String, what: String },
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// GPT-2's reversible byte → printable-char alphabet.
pub fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).unwrap_or('\0');
            n += 1;
            c
        };
    }
    table
}

/// Text → byte-alphabet string (how token texts are spelled in the vocabulary).
pub fn bytes_to_token_text(bytes: &[u8]) -> String {
    let t = byte_to_char_table();
    bytes.iter().map(|&b| t[b as usize]).collect()
}

pub struct Tokenizer {
    hf: HfTokenizer,
    /// Decoded bytes of every token.
    pieces: Vec<Vec<u8>>,
    types: Vec<i32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    /// End-of-generation tokens (eos, `<|im_end|>`, `<|endoftext|>` when present).
    pub eog: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokenizer({} tokens)", self.pieces.len())
    }
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let path = g.path().display().to_string();
        let bad = |what: String| TokenizerError::Bad { path: path.clone(), what };
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(bad(format!("tokenizer.ggml.model = {model:?}: only \"gpt2\" (byte-level BPE) is supported")));
        }
        let pre = g.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
        let regex = match pre {
            "qwen2" => QWEN2_PRE_REGEX,
            other => return Err(bad(format!("tokenizer.ggml.pre = {other:?}: only \"qwen2\" is supported"))),
        };
        let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        let types: Vec<i32> = match g.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
            Some(a) if a.len() == n => a.iter().map(|v| v.as_i64().unwrap_or(1) as i32).collect(),
            Some(a) => {
                return Err(bad(format!("tokenizer.ggml.token_type has {} entries for {n} tokens", a.len())));
            }
            None => vec![TOKEN_NORMAL; n],
        };
        let merges_raw = g.get_str_array("tokenizer.ggml.merges")?;
        let mut merges = Vec::with_capacity(merges_raw.len());
        for (i, m) in merges_raw.iter().enumerate() {
            let (a, b) = m.split_once(' ').ok_or_else(|| bad(format!("merge #{i} {m:?} is not \"left right\"")))?;
            merges.push((a.to_owned(), b.to_owned()));
        }
        let mut vocab: Vocab = Vocab::with_capacity(n);
        let mut specials = Vec::new();
        for (id, (&t, &ty)) in tokens.iter().zip(&types).enumerate() {
            let id = u32::try_from(id).map_err(|_| bad("too many tokens".into()))?;
            vocab.entry(t.to_owned()).or_insert(id);
            if ty == TOKEN_CONTROL || ty == TOKEN_USER_DEFINED {
                specials.push(AddedToken::from(t.to_owned(), true));
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| bad(format!("building the BPE model: {e}")))?;
        let mut hf = HfTokenizer::new(bpe);
        let split = Split::new(SplitPattern::Regex(regex.to_owned()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| bad(format!("pre-tokenizer regex: {e}")))?;
        hf.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
        ]))));
        hf.add_special_tokens(&specials);

        let table = byte_to_char_table();
        let mut inverse = HashMap::with_capacity(256);
        for (b, &c) in table.iter().enumerate() {
            inverse.insert(c, b as u8);
        }
        let pieces = tokens
            .iter()
            .zip(&types)
            .map(|(t, &ty)| match ty {
                TOKEN_CONTROL | TOKEN_USER_DEFINED | TOKEN_UNKNOWN => t.as_bytes().to_vec(),
                TOKEN_UNUSED => Vec::new(),
                _ => {
                    let mut out = Vec::with_capacity(t.len());
                    for ch in t.chars() {
                        match inverse.get(&ch) {
                            Some(&b) => out.push(b),
                            None => out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    out
                }
            })
            .collect();
        let id_key = |k: &str| -> Result<Option<u32>, TokenizerError> {
            match g.get(k) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(id) if (id as usize) < n => Ok(Some(id as u32)),
                    _ => Err(bad(format!("{k} = {} is not a token id below {n}", v.summary()))),
                },
            }
        };
        let bos = id_key("tokenizer.ggml.bos_token_id")?;
        let eos = id_key("tokenizer.ggml.eos_token_id")?;
        let add_bos = g.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
        let mut eog: Vec<u32> = eos.into_iter().collect();
        for (id, t) in tokens.iter().enumerate() {
            if types[id] == TOKEN_CONTROL && matches!(*t, "<|im_end|>" | "<|endoftext|>" | "<|eot_id|>") {
                eog.push(id as u32);
            }
        }
        eog.sort_unstable();
        eog.dedup();
        Ok(Tokenizer { hf, pieces, types, bos, eos, add_bos, eog })
    }

    pub fn n_vocab(&self) -> usize {
        self.pieces.len()
    }

    /// Token ids of `text` (plus BOS when the vocabulary asks for it).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.hf.encode(text, false).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if self.add_bos
            && let Some(b) = self.bos
        {
            ids.push(b);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The bytes a token renders to (possibly part of a UTF-8 sequence).
    pub fn piece(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], Vec::as_slice)
    }

    pub fn token_type(&self, id: u32) -> Option<i32> {
        self.types.get(id as usize).copied()
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| self.piece(i).iter().copied()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Accumulates token bytes and yields the longest valid UTF-8 prefix, so that streamed output
/// never splits a character.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_some() => {
                // Invalid, not merely incomplete: flush lossily.
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                return s;
            }
            Err(e) => e.valid_up_to(),
        };
        let rest = self.pending.split_off(valid);
        String::from_utf8(std::mem::replace(&mut self.pending, rest)).unwrap_or_default()
    }

    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
