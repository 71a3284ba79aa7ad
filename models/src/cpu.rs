//! Which instruction set Tandem's own CPU kernels run, chosen once per process at run time.
//!
//! The binary is built for the plain target; each hot kernel (the Q4_1 matmul, paged
//! attention, and the element-wise ops through [`isa_variants!`]) is compiled three times, for
//! [`Isa::Avx512`] (AVX-512 F/BW/VL/DQ with FMA and F16C), [`Isa::Avx2`] (AVX2 with FMA and
//! F16C) and [`Isa::Portable`] (plain Rust, any target), and the variant for the best
//! instruction set the CPU has runs.
//!
//! - `TANDEM_CPU_ISA=portable|avx2|avx512` caps the choice (tests, benchmarks, a suspected
//!   kernel bug); a cap above what the CPU has, or a value that is not one of these, is
//!   refused at first use with a warning and the detected set is used: no variant ever runs on a
//!   CPU without its instructions.
//! - [`Isa::set_active`] switches the variant for later calls in the whole process (benchmarks
//!   comparing variants in one run); the server never calls it.
//! - Invariant: the AVX2 and AVX-512 variants compute each output with the same operations in
//!   the same order as the portable code with fused multiply-adds, except where a kernel's docs
//!   say otherwise (the AVX-512 attention scores sum in another order, and the portable Q4_1
//!   variant rounds products separately on a target without FMA), so their results are
//!   bit-identical to that reference (tested per kernel for every variant this CPU runs).

use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction set a kernel variant is compiled for, from least to most capable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust for the build's target.
    Portable,
    /// x86-64 AVX2 + FMA + F16C (Haswell, Zen and later).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/DQ + FMA + F16C (Skylake-X, Zen 4 and later).
    Avx512,
}

/// The environment variable that caps the instruction set.
pub const ISA_ENV: &str = "TANDEM_CPU_ISA";

impl Isa {
    /// Every instruction set, least capable first.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// The name `TANDEM_CPU_ISA` takes and logs show.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Parses a name of [`Isa::name`].
    pub fn parse(s: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == s.trim())
    }

    /// Whether this CPU can run the variant.
    pub fn supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The most capable instruction set this CPU runs.
    pub fn detected() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.supported())
            .unwrap_or(Isa::Portable)
    }

    /// Every instruction set this CPU runs, least capable first.
    pub fn runnable() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.supported()).collect()
    }

    /// The instruction set the kernels use in this process: the detected one, capped by
    /// `TANDEM_CPU_ISA` where that names one this CPU runs (chosen at the first call).
    pub fn active() -> Isa {
        #[cfg(test)]
        if let Some(isa) = TEST_ISA.with(|t| t.get()) {
            return isa;
        }
        match ACTIVE.load(Ordering::Relaxed) {
            UNSET => {
                let cap = std::env::var(ISA_ENV).ok();
                let (isa, refused) = choose(Isa::detected(), cap.as_deref());
                if let Some(why) = refused {
                    tracing::warn!("{ISA_ENV}: {why}; using {}", isa.name());
                }
                // a concurrent first call chose the same: detection and the variable are fixed
                ACTIVE.store(isa as u8, Ordering::Relaxed);
                isa
            }
            v => Isa::ALL[v as usize],
        }
    }

    /// Makes later kernel calls in this process use `isa`; refused (naming it) where this CPU
    /// cannot run it.
    pub fn set_active(isa: Isa) -> Result<(), String> {
        if !isa.supported() {
            return Err(format!("this CPU cannot run the {} kernels", isa.name()));
        }
        ACTIVE.store(isa as u8, Ordering::Relaxed);
        Ok(())
    }
}

/// Which VNNI instruction (`vpdpbusd`: four 8-bit products summed into each 32-bit lane) the
/// integer kernels of the x86 variants may use: the EVEX form in the AVX-512 variant where the
/// CPU has AVX512-VNNI, the VEX form (AVX-VNNI) in the AVX2 variant where it has that. A VNNI
/// sum equals the `vpmaddubsw` + `vpmaddwd` pair it replaces bit for bit (the pair's 16-bit
/// step cannot saturate on 4-bit weights), so this changes speed only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vnni {
    /// No VNNI instruction in this variant (or VNNI disabled).
    Off,
    /// AVX-VNNI (VEX-encoded, 256-bit).
    Vex,
    /// AVX512-VNNI (EVEX-encoded, used on 256-bit registers).
    Evex,
}

/// The environment variable that disables VNNI (`0`; `1` or unset allows it), for comparisons
/// and suspected bugs.
pub const VNNI_ENV: &str = "TANDEM_CPU_VNNI";

/// Whether VNNI may be used: `TANDEM_CPU_VNNI` at the first call, or [`set_vnni_allowed`].
static VNNI_ALLOWED: AtomicU8 = AtomicU8::new(UNSET);

/// Allows or forbids VNNI for later kernel calls in this process (benchmarks comparing both
/// forms in one run; results do not change).
pub fn set_vnni_allowed(allowed: bool) {
    VNNI_ALLOWED.store(u8::from(allowed), Ordering::Relaxed);
}

/// The VNNI form the variant of `isa` uses on this CPU now.
pub fn vnni_for(isa: Isa) -> Vnni {
    let allowed = match VNNI_ALLOWED.load(Ordering::Relaxed) {
        UNSET => {
            let allowed = match std::env::var(VNNI_ENV).as_deref().map(str::trim) {
                Err(_) | Ok("" | "1") => true,
                Ok("0") => false,
                Ok(other) => {
                    tracing::warn!("{VNNI_ENV}={other} is not 0 or 1; VNNI stays allowed");
                    true
                }
            };
            set_vnni_allowed(allowed);
            allowed
        }
        v => v == 1,
    };
    if !allowed {
        return Vnni::Off;
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if is_x86_feature_detected!("avx512vnni") => Vnni::Evex,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if is_x86_feature_detected!("avxvnni") => Vnni::Vex,
        _ => Vnni::Off,
    }
}

/// Defines a function whose body is compiled for each instruction set and run in the variant of
/// [`Isa::active`]: loops in the body (and what it inlines) are vectorized for AVX-512 or AVX2
/// on CPUs that have them, without the build targeting them. The body must not use `unsafe`
/// intrinsics (its portable form runs anywhere); plain arithmetic compiles to the same results
/// in every variant (Rust neither reassociates nor contracts float operations).
macro_rules! isa_variants {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
            fn avx512($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }

            match $crate::cpu::Isa::active() {
                // SAFETY: `Isa::active` is only ever an instruction set this CPU runs.
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::Isa::Avx512 => unsafe { avx512($($arg),*) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                $crate::cpu::Isa::Avx2 => unsafe { avx2($($arg),*) },
                _ => body($($arg),*),
            }
        }
    };
}
pub(crate) use isa_variants;

#[cfg(test)]
thread_local! {
    /// An instruction set [`Isa::active`] answers on this thread only (tests of the variants;
    /// kernels that run on candle's pool threads take an explicit `Isa` instead).
    static TEST_ISA: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with [`Isa::active`] answering `isa` on this thread.
#[cfg(test)]
pub(crate) fn on_this_thread<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    assert!(isa.supported());
    TEST_ISA.with(|t| t.set(Some(isa)));
    let r = f();
    TEST_ISA.with(|t| t.set(None));
    r
}

/// The active instruction set as its index in [`Isa::ALL`], or [`UNSET`] before the first use.
static ACTIVE: AtomicU8 = AtomicU8::new(UNSET);
const UNSET: u8 = u8::MAX;

/// The instruction set for a CPU whose best is `detected`, given the cap `cap` (the value of
/// `TANDEM_CPU_ISA`, if set), and why the cap was refused if it was.
fn choose(detected: Isa, cap: Option<&str>) -> (Isa, Option<String>) {
    let Some(cap) = cap.filter(|c| !c.trim().is_empty()) else {
        return (detected, None);
    };
    match Isa::parse(cap) {
        Some(want) if want <= detected => (want, None),
        Some(want) => (
            detected,
            Some(format!(
                "{} asked for but this CPU's best is {}",
                want.name(),
                detected.name()
            )),
        ),
        None => (
            detected,
            Some(format!(
                "{cap:?} is not one of {}",
                Isa::ALL.map(Isa::name).join(", ")
            )),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_never_exceeds_the_cpu() {
        assert_eq!(choose(Isa::Avx512, None), (Isa::Avx512, None));
        assert_eq!(choose(Isa::Avx512, Some("avx2")), (Isa::Avx2, None));
        assert_eq!(choose(Isa::Avx2, Some(" portable ")), (Isa::Portable, None));
        let (isa, why) = choose(Isa::Avx2, Some("avx512"));
        assert_eq!(isa, Isa::Avx2);
        assert!(why.unwrap().contains("best is avx2"));
        let (isa, why) = choose(Isa::Portable, Some("sse9"));
        assert_eq!(isa, Isa::Portable);
        assert!(why.unwrap().contains("portable, avx2, avx512"));
    }

    #[test]
    fn detection_is_ordered() {
        let all = Isa::runnable();
        assert_eq!(all[0], Isa::Portable);
        assert_eq!(*all.last().unwrap(), Isa::detected());
        // a CPU with AVX-512 has AVX2
        if Isa::Avx512.supported() {
            assert!(Isa::Avx2.supported());
        }
    }
}
