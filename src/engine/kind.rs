//! The engines a transfer handler can be asked for, by name: the one list that the bindings, the
//! Python package (`kvoff._native.ENGINES`), the `kvoff` command's choices and the vLLM plug-in's
//! settings all take their names from, and the one place where a name and the tensors' placement
//! decide which engine serves. Beside it, [`CopyMethod`]: the CUDA engine's copy methods, which
//! take their names from [`EngineKind`] (a new method is a variant of both, here, and its code in
//! `engine/cuda/`: docs/design.md "Recipe: adding a copy method").

use crate::error::{KvoffError, Result};

/// An engine choice (the `engine=` setting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// CUDA with the method chosen per job when the GPU-side tensors are CUDA tensors, otherwise
    /// the host engine.
    Auto,
    /// The host engine: `memcpy` on worker threads (CPU tensors on both sides).
    Host,
    /// CUDA, method chosen per job (like `Auto`, but CUDA is required).
    Cuda,
    /// CUDA, batched DMA for every job.
    Dma,
    /// CUDA, the gather/scatter copy kernel (needs pinned, device-mapped host memory).
    Kernel,
    /// CUDA, kernel through device staging plus DMA of host-contiguous runs.
    Staged,
    /// CUDA, one `cuMemcpyAsync` per copy (a baseline for benchmarks).
    Loop,
}

impl EngineKind {
    /// Every choice, in the order the documentation lists them.
    pub const ALL: [Self; 7] = [
        Self::Auto,
        Self::Host,
        Self::Cuda,
        Self::Dma,
        Self::Kernel,
        Self::Staged,
        Self::Loop,
    ];

    /// The setting's spelling.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Host => "host",
            Self::Cuda => "cuda",
            Self::Dma => "dma",
            Self::Kernel => "kernel",
            Self::Staged => "staged",
            Self::Loop => "loop",
        }
    }

    /// Parses a name of [`ALL`](Self::ALL).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] naming the valid choices.
    pub fn parse(s: &str) -> Result<Self> {
        crate::error::parse_name(s, &Self::ALL, Self::name, "engine", |names| {
            let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
            quoted.join(", ")
        })
    }

    /// Whether the choice always needs CUDA (every one but `Auto` and `Host`).
    #[must_use]
    pub const fn needs_cuda(self) -> bool {
        !matches!(self, Self::Auto | Self::Host)
    }

    /// Decides between the host and a CUDA engine for GPU-side tensors placed as `gpu` (one entry
    /// per tensor: its CUDA device index, `None` for host memory; `names[i]` says what tensor `i`
    /// is, for messages), given whether CUDA is usable here. Returns whether a CUDA engine serves.
    ///
    /// # Errors
    /// [`KvoffError::CudaUnavailable`] when CUDA is needed and unusable here;
    /// [`KvoffError::InvalidArgument`] when the tensors do not fit the choice: host tensors with a
    /// CUDA engine, CUDA tensors with the host engine, tensors on several devices.
    pub fn resolve(self, gpu: &[Option<i64>], names: &[String], cuda_usable: bool) -> Result<bool> {
        let name = |i: usize| {
            names
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("GPU-side tensor {i}"))
        };
        let on_host = gpu.iter().position(Option::is_none);
        let on_cuda = gpu.iter().position(Option::is_some);
        let use_cuda = self.needs_cuda() || (self == Self::Auto && on_cuda.is_some());
        let me = self.name();
        if !use_cuda {
            if let Some(i) = on_cuda {
                return Err(KvoffError::arg(format!(
                    "engine \"host\" copies with memcpy, but {} is on cuda:{}; use engine=\"auto\" \
                     or \"cuda\" for GPU tensors",
                    name(i),
                    gpu[i].unwrap_or(0)
                )));
            }
            return Ok(false);
        }
        let where_ = on_host.map(|i| format!("{} is on cpu", name(i)));
        if !cuda_usable {
            return Err(KvoffError::CudaUnavailable(format!(
                "engine {me:?} needs CUDA, but kvoff found no CUDA driver or device{}; use \
                 engine=\"auto\" or \"host\"",
                where_.map(|w| format!(" (and {w})")).unwrap_or_default()
            )));
        }
        if let Some(w) = where_ {
            return Err(KvoffError::arg(format!(
                "engine {me:?} copies between CUDA device memory and host memory, but {w}; use \
                 engine=\"host\" (or \"auto\") for CPU tensors"
            )));
        }
        let first = gpu.first().copied().flatten().unwrap_or(0);
        if let Some(i) = gpu.iter().position(|d| *d != Some(first)) {
            return Err(KvoffError::arg(format!(
                "GPU-side tensors are on different devices ({} on cuda:{first}, {} on cuda:{}); \
                 one handler serves one device",
                name(0),
                name(i),
                gpu[i].unwrap_or(0)
            )));
        }
        Ok(true)
    }
}

/// How a job's bytes are moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyMethod {
    /// Choose per job (page size, copy count, whether the host memory is mapped).
    Auto,
    /// Batched DMA: one `cuMemcpyBatchAsync` per job (or a per-copy loop without it).
    Dma,
    /// The gather/scatter copy kernel (needs pinned, device-mapped host memory).
    Kernel,
    /// One `cuMemcpyAsync` per copy (a baseline for benchmarks).
    Loop,
    /// Staged: the kernel gathers (stores) or scatters (loads) the GPU side through device staging
    /// slots, and the copy engines move host-contiguous runs over PCIe with batched DMA. The job
    /// is cut into chunks (2, 4, 8 … MiB up to a slot) that alternate between two streams, so one
    /// stream's kernel overlaps the other's DMA; each chunk is packed on the CPU just before it is
    /// enqueued, so the device starts after little CPU work. Two driver calls per chunk. Best when
    /// host-side runs are long (kvoff's block-major host layout) and especially when stores and
    /// loads run at the same time.
    Staged,
}

impl CopyMethod {
    /// The methods a job can run (every one but `Auto`, which picks one of these per job), in the
    /// order of `CudaEngine::method_counts`.
    pub const RUN: [Self; 4] = [Self::Dma, Self::Kernel, Self::Loop, Self::Staged];

    /// The method a CUDA engine of kind `kind` runs: `Auto` for `"auto"` and `"cuda"`, the named
    /// method for the others; `None` for `"host"`. The names are [`EngineKind`]'s (one list).
    #[must_use]
    pub const fn for_kind(kind: EngineKind) -> Option<Self> {
        match kind {
            EngineKind::Host => None,
            EngineKind::Auto | EngineKind::Cuda => Some(Self::Auto),
            EngineKind::Dma => Some(Self::Dma),
            EngineKind::Kernel => Some(Self::Kernel),
            EngineKind::Loop => Some(Self::Loop),
            EngineKind::Staged => Some(Self::Staged),
        }
    }

    /// The engine kind that runs this method (`Auto`: `"auto"`).
    #[must_use]
    pub const fn kind(self) -> EngineKind {
        match self {
            Self::Auto => EngineKind::Auto,
            Self::Dma => EngineKind::Dma,
            Self::Kernel => EngineKind::Kernel,
            Self::Loop => EngineKind::Loop,
            Self::Staged => EngineKind::Staged,
        }
    }

    /// Parses an engine name that names a CUDA method (every [`EngineKind`] name but `"host"`;
    /// `"cuda"` is `Auto`).
    ///
    /// # Errors
    /// [`KvoffError::InvalidArgument`] naming the valid choices.
    pub fn parse(s: &str) -> Result<Self> {
        if let Some(m) = EngineKind::parse(s).ok().and_then(Self::for_kind) {
            return Ok(m);
        }
        let valid: Vec<String> = EngineKind::ALL
            .iter()
            .filter(|k| Self::for_kind(**k).is_some())
            .map(|k| format!("{:?}", k.name()))
            .collect();
        Err(KvoffError::arg(format!(
            "unknown CUDA copy method {s:?}; valid: {}",
            valid.join(", ")
        )))
    }

    /// Lower-case name (the [`EngineKind`] name of [`Self::kind`]).
    #[must_use]
    pub const fn name(self) -> &'static str {
        self.kind().name()
    }
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::{CopyMethod, EngineKind};

    #[test]
    fn copy_methods_take_their_names_from_the_engine_kinds() {
        for k in EngineKind::ALL {
            match CopyMethod::for_kind(k) {
                None => assert_eq!(k, EngineKind::Host),
                Some(m) => {
                    assert_eq!(CopyMethod::parse(k.name()).unwrap(), m);
                    assert!(
                        m == CopyMethod::Auto || CopyMethod::RUN.contains(&m),
                        "{m:?}"
                    );
                }
            }
        }
        for m in CopyMethod::RUN {
            assert_eq!(CopyMethod::for_kind(m.kind()), Some(m));
        }
        let e = CopyMethod::parse("host").unwrap_err().to_string();
        assert!(e.contains("\"dma\""), "{e}");
    }

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for k in EngineKind::ALL {
            assert_eq!(EngineKind::parse(k.name()).unwrap(), k);
        }
        let e = EngineKind::parse("fast").unwrap_err().to_string();
        assert!(
            e.contains("\"auto\", \"host\", \"cuda\", \"dma\", \"kernel\", \"staged\", \"loop\""),
            "{e}"
        );
    }

    #[test]
    fn resolve_follows_the_placement() {
        let n = vec!["a".to_owned(), "b".to_owned()];
        assert!(!EngineKind::Auto.resolve(&[None, None], &n, true).unwrap());
        assert!(EngineKind::Auto
            .resolve(&[Some(1), Some(1)], &n, true)
            .unwrap());
        assert!(EngineKind::Host.resolve(&[Some(0)], &n, true).is_err());
        let e = EngineKind::Dma.resolve(&[None], &n, false).unwrap_err();
        assert!(matches!(e, crate::KvoffError::CudaUnavailable(_)), "{e}");
        assert!(e.to_string().contains("a is on cpu"), "{e}");
        let e = EngineKind::Dma
            .resolve(&[Some(0), None], &n, true)
            .unwrap_err();
        assert!(e.to_string().contains("b is on cpu"), "{e}");
        let e = EngineKind::Cuda
            .resolve(&[Some(0), Some(1)], &n, true)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("different devices (a on cuda:0, b on cuda:1)"),
            "{e}"
        );
    }
}
