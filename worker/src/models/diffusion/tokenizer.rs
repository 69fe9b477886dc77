//! CLIP (and, below, T5) tokenization of prompts, as diffusers' pipelines call `CLIPTokenizer`:
//! `padding="max_length", max_length=77, truncation=True`.
//!
//! Built from the Optimum layout's `tokenizer/` directory (`vocab.json`, `merges.txt`,
//! `tokenizer_config.json`; Optimum writes no `tokenizer.json`) with the `tokenizers` crate, in
//! the shape transformers' own converter gives the fast CLIP tokenizer: NFC, whitespace runs to
//! one space, lowercase; split on CLIP's pattern, byte-level; BPE with `</w>` word ends. A prompt
//! longer than the model's window is truncated to start + 75 tokens + end, as diffusers does (it
//! warns; it does not refuse). Python's slow tokenizer also runs `ftfy.fix_text`, which rewrites
//! HTML entities, curly quotes and ligatures; plain text tokenizes the same.

use std::path::Path;

use thiserror::Error;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Lowercase, NFC, Replace, Sequence as Normalizers};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizers;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

/// CLIP's word pattern (after lowercasing, so its case-insensitive flag does not matter).
const CLIP_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error("{file}: {reason}")]
    File { file: String, reason: String },
    #[error("tokenizing {prompt:?}: {reason}")]
    Encode { prompt: String, reason: String },
}

/// A model's prompt tokenizer.
pub struct ClipTokenizer {
    tokenizer: Tokenizer,
    bos: u32,
    eos: u32,
    pad: u32,
    max_length: usize,
}

impl ClipTokenizer {
    /// Loads `dir` (the model's `tokenizer/`).
    pub fn load(dir: &Path) -> Result<ClipTokenizer, TokenizerError> {
        let file_error = |file: &Path, reason: String| TokenizerError::File {
            file: file.display().to_string(),
            reason,
        };
        let vocab = dir.join("vocab.json");
        let merges = dir.join("merges.txt");
        let config_path = dir.join("tokenizer_config.json");
        for f in [&vocab, &merges, &config_path] {
            if !f.is_file() {
                return Err(file_error(f, "missing".into()));
            }
        }
        let config: serde_json::Value = std::fs::read_to_string(&config_path)
            .map_err(|e| e.to_string())
            .and_then(|t| super::python_json::parse(&t).map_err(|e| e.to_string()))
            .map_err(|e| file_error(&config_path, e))?;
        let token_of = |key: &str, default: &str| -> String {
            match &config[key] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).unwrap_or(default).to_owned(),
                _ => default.to_owned(),
            }
        };
        let (bos, eos) = (token_of("bos_token", "<|startoftext|>"), token_of("eos_token", "<|endoftext|>"));
        let pad = token_of("pad_token", &eos);
        let unk = token_of("unk_token", &eos);
        let max_length = config["model_max_length"]
            .as_u64()
            .filter(|&n| (3..=4096).contains(&n))
            .unwrap_or(77) as usize;

        let bpe = BPE::from_file(&vocab.to_string_lossy(), &merges.to_string_lossy())
            .end_of_word_suffix("</w>".into())
            .unk_token(unk)
            .build()
            .map_err(|e| file_error(&vocab, e.to_string()))?;
        let mut tokenizer = Tokenizer::new(bpe);
        let whitespace = Replace::new(tokenizers::normalizers::replace::ReplacePattern::Regex(r"\s+".into()), " ")
            .map_err(|e| file_error(dir, e.to_string()))?;
        tokenizer.with_normalizer(Some(NormalizerWrapper::Sequence(Normalizers::new(vec![
            NormalizerWrapper::NFC(NFC),
            NormalizerWrapper::Replace(whitespace),
            NormalizerWrapper::Lowercase(Lowercase),
        ]))));
        let split = Split::new(SplitPattern::Regex(CLIP_PATTERN.into()), SplitDelimiterBehavior::Removed, true)
            .map_err(|e| file_error(dir, e.to_string()))?;
        tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(PreTokenizers::new(vec![
            PreTokenizerWrapper::Split(split),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]))));
        // Written in a prompt, the start, end and padding markers are those tokens, as in
        // transformers (SDXL's second tokenizer pads with `!`: a `!` in a prompt is id 0 there).
        let mut specials = vec![AddedToken::from(bos.clone(), true), AddedToken::from(eos.clone(), true)];
        if pad != bos && pad != eos {
            specials.push(AddedToken::from(pad.clone(), true));
        }
        tokenizer.add_special_tokens(&specials);
        let id = |token: &str| {
            tokenizer
                .token_to_id(token)
                .ok_or_else(|| file_error(&vocab, format!("has no {token:?}")))
        };
        Ok(ClipTokenizer {
            bos: id(&bos)?,
            eos: id(&eos)?,
            pad: id(&pad)?,
            max_length,
            tokenizer,
        })
    }

    /// The window every prompt is padded or truncated to (77 for CLIP).
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// Ids of `prompt`: start, at most `max_length - 2` tokens, end, then padding.
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.tokenizer.encode(prompt, false).map_err(|e| TokenizerError::Encode {
            prompt: prompt.chars().take(80).collect(),
            reason: e.to_string(),
        })?;
        let words = encoding.get_ids();
        let kept = words.len().min(self.max_length - 2);
        let mut ids = Vec::with_capacity(self.max_length);
        ids.push(self.bos);
        ids.extend_from_slice(&words[..kept]);
        ids.push(self.eos);
        ids.resize(self.max_length, self.pad);
        Ok(ids)
    }

    /// How many tokens of `prompt` do not fit the window (0 when it fits).
    pub fn overflow(&self, prompt: &str) -> Result<usize, TokenizerError> {
        let n = self
            .tokenizer
            .encode(prompt, false)
            .map_err(|e| TokenizerError::Encode {
                prompt: prompt.chars().take(80).collect(),
                reason: e.to_string(),
            })?
            .len();
        Ok(n.saturating_sub(self.max_length - 2))
    }
}

/// T5's tokenizer (FLUX's `tokenizer_2/`, SD3's `tokenizer_3/`), from the `tokenizer.json` the
/// model ships (SentencePiece Unigram with its own normalizer), as the pipelines call it:
/// `padding="max_length", max_length=L, truncation=True`: at most `L − 1` tokens, `</s>`, then
/// padding.
pub struct T5Tokenizer {
    tokenizer: Tokenizer,
    eos: u32,
    pad: u32,
}

impl T5Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn load(dir: &Path) -> Result<T5Tokenizer, TokenizerError> {
        let file = dir.join("tokenizer.json");
        let file_error = |reason: String| TokenizerError::File {
            file: file.display().to_string(),
            reason,
        };
        let mut tokenizer = Tokenizer::from_file(&file).map_err(|e| file_error(e.to_string()))?;
        // Truncation and padding are this type's, whatever the file stores.
        tokenizer.with_truncation(None).map_err(|e| file_error(e.to_string()))?;
        tokenizer.with_padding(None);
        let id = |token: &str| tokenizer.token_to_id(token).ok_or_else(|| file_error(format!("has no {token:?}")));
        Ok(T5Tokenizer {
            eos: id("</s>")?,
            pad: id("<pad>")?,
            tokenizer,
        })
    }

    /// Ids of `prompt` in a window of `max_length` (at least 2).
    pub fn encode(&self, prompt: &str, max_length: usize) -> Result<Vec<u32>, TokenizerError> {
        let words = self.words(prompt)?;
        let kept = words.len().min(max_length.saturating_sub(1));
        let mut ids = Vec::with_capacity(max_length);
        ids.extend_from_slice(&words[..kept]);
        ids.push(self.eos);
        ids.resize(max_length.max(1), self.pad);
        Ok(ids)
    }

    fn words(&self, prompt: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self.tokenizer.encode(prompt, false).map_err(|e| TokenizerError::Encode {
            prompt: prompt.chars().take(80).collect(),
            reason: e.to_string(),
        })?;
        Ok(encoding.get_ids().to_vec())
    }
}
