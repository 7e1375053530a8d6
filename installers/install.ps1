<#
.SYNOPSIS
Install volunteerd for this user on Windows, or upgrade it in place.

.DESCRIPTION
Creates an isolated Python environment in %LOCALAPPDATA%\volunteerd\env, installs
PyTorch there first (the CUDA build when nvidia-smi finds an NVIDIA GPU, else the CPU
build), then volunteerd (from a wheel, or a checkout: by default the one this script
is in), puts a
`volunteerd` command on the user's PATH (%LOCALAPPDATA%\volunteerd\bin\volunteerd.cmd)
and runs `volunteerd service install`: Task Scheduler tasks that start the daemon and
the tray at logon, both started now. Nothing needs an administrator.

Run it again to upgrade: the environment is kept (torch too, while it is the pinned
version), volunteerd is reinstalled, the daemon restarted. Identity, configuration,
checkpoints and statistics live in %LOCALAPPDATA%\volunteerd\volunteerd, outside the
environment, and are never touched.

torch (the pinned version, 2.13.0; -Torch overrides): on Windows the package index's
wheel is the CPU build; with an NVIDIA GPU (nvidia-smi -L lists one) the CUDA build
comes from PyTorch's CUDA index (download.pytorch.org/whl/cu128). An installed torch of
the pinned version is kept on upgrades; -Torch cpu or -Torch cuda replaces a build of
the other kind. (PyTorch has no ROCm build for Windows.)

.EXAMPLE
powershell -ExecutionPolicy Bypass -File installers\install.ps1
.EXAMPLE
powershell -ExecutionPolicy Bypass -File installers\install.ps1 -Wheel dist\volunteerd-0.1.0-py3-none-any.whl -NoTray
#>
[CmdletBinding()]
param(
    # Install this volunteerd wheel.
    [string]$Wheel = "",
    # Install from this checkout of volunteerd (default: the checkout this script is in).
    [string]$Source = "",
    # auto (default), cpu or cuda (an NVIDIA GPU).
    [ValidateSet("auto", "cpu", "cuda")]
    [string]$Torch = "auto",
    # The Python (3.11 or newer) that creates the environment, e.g. "C:\Python312\python.exe";
    # replaces an existing environment. Default: py -3.13, -3.12, -3.11, then python.
    [string]$Python = "",
    # Register the autostart, but start nothing now.
    [switch]$NoStart,
    # No tray icon (the daemon only).
    [switch]$NoTray,
    # Print what would be done, change nothing.
    [switch]$DryRun
)

Set-StrictMode -Version Latest
$ErrorActionPreference = "Stop"

$TorchVersion = "2.13.0"
# PyTorch's CUDA builds for Windows: move this together with $TorchVersion.
$CudaIndex = "https://download.pytorch.org/whl/cu128"

function Say([string]$Text) { Write-Host "install: $Text" }

function Fail([string]$Text) {
    [Console]::Error.WriteLine("install: error: $Text")
    exit 1
}

# Run a program; stop with its words if it fails.
function Invoke-Native([string]$Exe, [string[]]$Arguments) {
    & $Exe @Arguments
    if ($LASTEXITCODE -ne 0) {
        Fail "'$Exe $($Arguments -join ' ')' failed (exit code $LASTEXITCODE)"
    }
}

# Whether a command (program and its first arguments) runs a Python 3.11 or newer.
function Test-Python([string[]]$Command) {
    $ErrorActionPreference = "Continue"
    if (-not (Get-Command $Command[0] -ErrorAction SilentlyContinue)) { return $false }
    $rest = @($Command | Select-Object -Skip 1)
    & $Command[0] @rest -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>$null | Out-Null
    return ($LASTEXITCODE -eq 0)
}

function Find-Python {
    if ($Python) {
        if (-not (Test-Python @($Python))) { Fail "'$Python' is not a Python 3.11 or newer" }
        return , @($Python)
    }
    foreach ($candidate in @(@("py", "-3.13"), @("py", "-3.12"), @("py", "-3.11"), @("python"))) {
        if (Test-Python $candidate) { return , $candidate }
    }
    Fail ("volunteerd needs Python 3.11 or newer: install it from python.org (with the " +
        "'py' launcher), then run this again")
}

# What the rule picks on this machine: cuda or cpu.
function Get-TorchKind {
    $ErrorActionPreference = "Continue"
    if (Get-Command nvidia-smi -ErrorAction SilentlyContinue) {
        $gpus = & nvidia-smi -L 2>$null | Where-Object { $_ -match "^GPU" }
        if ($LASTEXITCODE -eq 0 -and $gpus) { return "cuda" }
    }
    return "cpu"
}

function Get-TorchText([string]$Plan) {
    switch ($Plan) {
        "keep" { return "keep the installed torch $script:TorchInstalled" }
        "cpu" { return "torch==$TorchVersion, the CPU build, from the package index" }
        "cuda" { return "torch==$TorchVersion, the CUDA build (an NVIDIA GPU was found), from $CudaIndex" }
    }
}

$Base = Join-Path $env:LOCALAPPDATA "volunteerd"
$EnvDir = Join-Path $Base "env"
$EnvPython = Join-Path $EnvDir "Scripts\python.exe"
$Volunteerd = Join-Path $EnvDir "Scripts\volunteerd.exe"
$BinDir = Join-Path $Base "bin"
$Shim = Join-Path $BinDir "volunteerd.cmd"

function Invoke-Pip([string[]]$Arguments) {
    Invoke-Native $EnvPython (@("-m", "pip", "--disable-pip-version-check") + $Arguments)
}

function Install-Torch([string]$Plan) {
    $installed = $script:TorchInstalled
    switch ($Plan) {
        "keep" { return }
        "cpu" {
            if ($installed -eq $TorchVersion) { return }
            if ($installed) { Invoke-Pip @("uninstall", "--quiet", "--yes", "torch") }
            Invoke-Pip @("install", "--quiet", "torch==$TorchVersion")
            return
        }
        "cuda" {
            if ($installed -like "$TorchVersion+cu*") { return }
            if ($installed) { Invoke-Pip @("uninstall", "--quiet", "--yes", "torch") }
            Invoke-Pip @("install", "--quiet", "--extra-index-url", $CudaIndex, "torch==$TorchVersion")
            return
        }
    }
}

# -- the plan ----------------------------------------------------------------------------

if ($Wheel -and $Source) { Fail "-Wheel and -Source exclude each other" }
if ($Wheel) {
    if (-not (Test-Path -PathType Leaf $Wheel)) { Fail "no wheel at '$Wheel'" }
    $Wheel = (Resolve-Path $Wheel).Path
}
function Test-Checkout([string]$Dir) {
    $project = Join-Path $Dir "pyproject.toml"
    return (Test-Path -PathType Leaf $project) -and
        [bool](Select-String -Path $project -Pattern '^name = "volunteerd"$' -Quiet)
}
if (-not $Wheel -and -not $Source) {
    # volunteerd is not on the package index: the checkout this script came with
    $here = Split-Path -Parent $PSScriptRoot
    if (-not ($here -and (Test-Checkout $here))) {
        Fail "name what to install: -Source DIR (a checkout of volunteerd) or -Wheel FILE"
    }
    $Source = $here
}
if ($Source) {
    if (-not (Test-Checkout $Source)) { Fail "'$Source' is not a volunteerd checkout" }
    $Source = (Resolve-Path $Source).Path
}

$envWorks = (Test-Path $EnvPython) -and (Test-Python @($EnvPython))
if ($envWorks -and -not $Python) {
    $Action = "upgrade"
    $ErrorActionPreference = "Continue"
    # (No double quotes inside: Windows PowerShell 5.1 drops them from native arguments.)
    $script:TorchInstalled = (& $EnvPython -c "import importlib.metadata as m; print(m.version('torch'))" 2>$null)
    if ($LASTEXITCODE -ne 0) { $script:TorchInstalled = "" }
    $ErrorActionPreference = "Stop"
} else {
    $Action = "create"
    $BasePython = Find-Python
    $script:TorchInstalled = ""
}

$TorchPlan = $Torch
if ($Torch -eq "auto") {
    if ($script:TorchInstalled -and ($script:TorchInstalled -split "\+")[0] -eq $TorchVersion) {
        $TorchPlan = "keep"
    } else {
        $TorchPlan = Get-TorchKind
    }
}

if ($Wheel) { $SourceText = "volunteerd from $Wheel" }
else { $SourceText = "volunteerd from the checkout $Source" }
$ServiceFlags = @()
if ($NoStart) { $ServiceFlags += "--no-start" }
if ($NoTray) { $ServiceFlags += "--no-tray" }

if ($DryRun) {
    if ($Action -eq "create") {
        Say "would create the environment $EnvDir with $($BasePython -join ' ')"
    } else {
        Say "would upgrade the environment $EnvDir"
    }
    Say "would install torch: $(Get-TorchText $TorchPlan)"
    Say "would install $SourceText"
    Say "would put $Shim on your PATH"
    Say "would run: volunteerd service install $($ServiceFlags -join ' ')"
    exit 0
}

# -- the environment ---------------------------------------------------------------------

if ($Action -eq "upgrade" -and (Test-Path $Volunteerd)) {
    # The daemon and the tray hold the environment's files open: stop them first;
    # `service install` below puts them back.
    Say "stopping the installed volunteerd for the upgrade"
    & $Volunteerd service uninstall
    if ($LASTEXITCODE -ne 0) { Say "(could not stop it cleanly; carrying on)" }
}
if ($Action -eq "create") {
    if (Test-Path $EnvDir) {
        Say "removing the old environment $EnvDir"
        Remove-Item -Recurse -Force $EnvDir
    }
    Say "creating the environment $EnvDir"
    New-Item -ItemType Directory -Force $Base | Out-Null
    $rest = @($BasePython | Select-Object -Skip 1)
    Invoke-Native $BasePython[0] ($rest + @("-m", "venv", $EnvDir))
} else {
    Say "upgrading the environment $EnvDir"
}
Invoke-Pip @("install", "--quiet", "--upgrade", "pip")

if ($TorchPlan -eq "keep") { Say "keeping torch $script:TorchInstalled" }
else { Say "installing $(Get-TorchText $TorchPlan)" }
Install-Torch $TorchPlan

# -- volunteerd --------------------------------------------------------------------------

if ($Source) {
    $buildDir = Join-Path ([System.IO.Path]::GetTempPath()) ("volunteerd-" + [guid]::NewGuid())
    Say "building a wheel from $Source"
    Invoke-Pip @("wheel", "--quiet", "--no-deps", "--wheel-dir", $buildDir, $Source)
    $Wheel = (Get-ChildItem -Path $buildDir -Filter "volunteerd-*.whl" | Select-Object -First 1).FullName
}
Say "installing $SourceText"
# --upgrade installs what the wheel needs (torch stays: it is in range); the second
# step replaces volunteerd even when the wheel has the installed version number.
Invoke-Pip @("install", "--quiet", "--upgrade", $Wheel)
Invoke-Pip @("install", "--quiet", "--no-deps", "--force-reinstall", $Wheel)
if ($Source) { Remove-Item -Recurse -Force $buildDir }
$Version = (& $Volunteerd --version)

# The command: a one-line shim in a folder of its own on the user's PATH (the
# environment's Scripts folder would put its python.exe and pip.exe there too).
# cmd reads a .cmd file in the OEM code page, and -Encoding ASCII turns every other
# letter into "?": the shim names the program through %LOCALAPPDATA% (where $Base
# always is; cmd expands it when the shim runs), so the line is ASCII whatever letters
# the user's folder has (an accented or Cyrillic user name).
New-Item -ItemType Directory -Force $BinDir | Out-Null
Set-Content -Path $Shim -Encoding ASCII -Value '@"%LOCALAPPDATA%\volunteerd\env\Scripts\volunteerd.exe" %*'
$userPath = [Environment]::GetEnvironmentVariable("Path", "User")
$entries = @()
if ($userPath) { $entries = @($userPath -split ";" | Where-Object { $_ }) }
if ($entries -notcontains $BinDir) {
    Say "adding $BinDir to your PATH (new terminals see it)"
    [Environment]::SetEnvironmentVariable("Path", (($entries + $BinDir) -join ";"), "User")
}

# -- autostart, start ---------------------------------------------------------------------

Say "registering the autostart: volunteerd service install $($ServiceFlags -join ' ')"
& $Volunteerd service install @ServiceFlags
if ($LASTEXITCODE -ne 0) {
    Fail "volunteerd is installed, but 'volunteerd service install' failed (see above)"
}

Write-Host ""
Write-Host "$Version is installed in $EnvDir"
if ($NoStart) {
    Write-Host "volunteerd starts at your next logon (or now: volunteerd service install)"
} else {
    $ErrorActionPreference = "Continue"
    $url = (& $Volunteerd dashboard --print 2>$null)
    if ($LASTEXITCODE -eq 0 -and $url) {
        Write-Host "The dashboard: $(($url -split '#')[0])  (open it with: volunteerd dashboard)"
    } else {
        Write-Host "volunteerd does not answer yet: see 'volunteerd service status'"
    }
}
Write-Host "Where its files are: volunteerd paths. To remove it: installers\uninstall.ps1"
