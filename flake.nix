{
  description = "KMesh: safe, fast reuse of shared KV-cache state (dev shell)";

  # The branch is what `nix flake update` follows; flake.lock pins it to one revision (rev + narHash +
  # lastModified). That triple was not computed here (no network for nix on the build machines): it is the one
  # NixOS/nixos-channel-scripts committed in flake.lock at 050d46f79ccd (renovate "Lock file maintenance",
  # 2026-01-12; there `original.ref` is nixos-25.05-small, the same release). Not exercised offline: see README.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.05";

  outputs = { self, nixpkgs }:
    let
      system = "x86_64-linux";
      pkgs = import nixpkgs {
        inherit system;
        config.allowUnfree = true;          # the CUDA toolkit is unfree
      };
    in {
      devShells.${system}.default = pkgs.mkShell {
        packages = [
          pkgs.python311                    # the pins in requirements/cpu.lock are for CPython 3.11
          pkgs.cudaPackages.cuda_nvcc       # kernels/*.cu -> sm_90 cubins (the `kernels` stage)
          pkgs.cudaPackages.cuda_cudart
          pkgs.graphviz                     # snakemake --dag | dot
          pkgs.gnumake
          pkgs.git
          pkgs.gcc
        ];
        # Same environment as `make env`: a venv from the hash lock (pip --require-hashes --no-deps).
        shellHook = ''
          export KMESH_PYTHON=${pkgs.python311}/bin/python3.11
          export LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
          scripts/setup-env.sh
          export PATH="$PWD/.venv/bin:$PATH"
        '';
      };
    };
}
