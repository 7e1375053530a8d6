<#
.SYNOPSIS
Remove what installers\install.ps1 installed for this user.

.DESCRIPTION
Stops the daemon and the tray and removes their Task Scheduler tasks (`volunteerd
service uninstall`), then removes the environment (%LOCALAPPDATA%\volunteerd\env), the
`volunteerd` command and its PATH entry. The user's data stays in
%LOCALAPPDATA%\volunteerd\volunteerd (identity, configuration, checkpoints,
statistics: a later install carries on with them) unless -Purge, which removes
%LOCALAPPDATA%\volunteerd altogether.

.EXAMPLE
powershell -ExecutionPolicy Bypass -File installers\uninstall.ps1 -Purge
#>
[CmdletBinding()]
param(
    # Also remove this user's volunteerd data, configuration and cache.
    [switch]$Purge
)

Set-StrictMode -Version Latest
$ErrorActionPreference = "Stop"

function Say([string]$Text) { Write-Host "uninstall: $Text" }

function Fail([string]$Text) {
    [Console]::Error.WriteLine("uninstall: error: $Text")
    exit 1
}

# The layout of install.ps1; the data folder is appdirs' (volunteerd/paths.py).
$Base = Join-Path $env:LOCALAPPDATA "volunteerd"
$EnvDir = Join-Path $Base "env"
$Volunteerd = Join-Path $EnvDir "Scripts\volunteerd.exe"
$DataDir = Join-Path $Base "volunteerd"
$BinDir = Join-Path $Base "bin"

# -- stop, forget the autostart ---------------------------------------------------------

$works = $false
if (Test-Path $Volunteerd) {
    $ErrorActionPreference = "Continue"
    & $Volunteerd --version 2>$null | Out-Null
    $works = ($LASTEXITCODE -eq 0)
    $ErrorActionPreference = "Stop"
}
if ($works) {
    Say "stopping volunteerd and removing its autostart: volunteerd service uninstall"
    $said = & $Volunteerd service uninstall  # its stdout; errors still reach the console
    $stopped = $LASTEXITCODE
    foreach ($line in $said) {
        # its line on the data it leaves alone is not the last word: -Purge removes it
        if (-not ($Purge -and "$line".EndsWith("are not touched by this command"))) {
            Write-Output "$line"
        }
    }
    if ($stopped -ne 0) { Fail "'volunteerd service uninstall' failed (see above)" }
} else {
    # No working environment to ask: remove its tasks directly.
    Say "no working volunteerd in $EnvDir; removing its Task Scheduler tasks directly"
    $ErrorActionPreference = "Continue"
    foreach ($task in @("volunteerd\tray", "volunteerd\daemon")) {
        & schtasks /End /TN $task 2>$null | Out-Null
        & schtasks /Delete /TN $task /F 2>$null | Out-Null
    }
    $ErrorActionPreference = "Stop"
}

# -- the installation --------------------------------------------------------------------

$userPath = [Environment]::GetEnvironmentVariable("Path", "User")
if ($userPath) {
    $entries = @($userPath -split ";" | Where-Object { $_ })
    if ($entries -contains $BinDir) {
        Say "removing $BinDir from your PATH"
        $kept = @($entries | Where-Object { $_ -ne $BinDir })
        [Environment]::SetEnvironmentVariable("Path", ($kept -join ";"), "User")
    }
}
foreach ($dir in @($BinDir, $EnvDir)) {
    if (Test-Path $dir) {
        Say "removing $dir"
        Remove-Item -Recurse -Force $dir
    }
}

# -- the user's data ---------------------------------------------------------------------

if ($Purge) {
    if (Test-Path $Base) {
        Say "removing $Base (data, configuration, cache)"
        Remove-Item -Recurse -Force $Base
    }
    Say "volunteerd and all its data are removed"
} else {
    Say "volunteerd is removed; your data and settings stay in $DataDir"
    Say "(a new install carries on with them). To remove them too: uninstall.ps1 -Purge"
}
